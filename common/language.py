"""BabyGPT's data (--model gpt): sequences of tokens and, for each position, the token the model should predict
next (-100 where nothing can be predicted: the loss and the accuracy skip it). Two sources, as tensors like the
images' (docs/language.md):

* `copy` (built in, the default): a sequence is random tokens, then the same tokens again. The second half can be
  predicted only from the first, half a sequence back: a longer --seq-len means more to hold and a longer reach,
  and the score reads directly: the share of the copied tokens predicted exactly.
* `text` (--data-file PATH): any text file as bytes (a vocabulary of 256), cut into sequences by position, the
  first 90 % for training and the rest for testing; every next byte is a target.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from common.errors import ConfigError

if TYPE_CHECKING:  # (torch loads in the functions that need it: the runners' preflight reads a file without it)
    import torch

    from common.config import Config

COPY_VOCAB = 128  # the built-in copy task draws its tokens from 0..127
BYTE_VOCAB = 256
IGNORE = -100  # F.cross_entropy's ignore_index: a position whose next token cannot be known (the random half)
TEST_SHARE = 0.1  # --data-file: the last 10 % of the file is the test split


def load_sequences(cfg: Config) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int]:
    """The training and test splits of --dataset copy or text, as (tokens, next tokens), and the vocabulary: the
    model's (a published shape's own is larger than the data's)."""
    from common.model_sizes import gpt_vocab

    if cfg.dataset == "copy":
        sizes = ((cfg.train_size, False), (cfg.test_size, True))
        train, test = (make_copy(n, cfg.seq_len, seed=cfg.seed, test=t) for n, t in sizes)
    else:
        train, test = (read_text(cfg.data_file, cfg.seq_len, test=t) for t in (False, True))
    return train, test, gpt_vocab(cfg.model_size, cfg.dataset)


def make_copy(n: int, seq_len: int, *, seed: int, test: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` copy sequences (int64 [n, seq_len]): h = seq_len / 2 random tokens a_1 .. a_h, then a_1 .. a_h again; the
    targets are the copy's tokens (at position h - 1 + i, a_(i+1)), -100 over the random half. The same for a seed
    on every rank; the test split from its own stream."""
    import torch

    generator = torch.Generator().manual_seed(seed * 2 + int(test) + 7_919)
    half = seq_len // 2
    first = torch.randint(0, COPY_VOCAB, (n, half), generator=generator)
    tokens = torch.cat([first, first], dim=1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, half - 1 : seq_len - 1] = first  # each position of the copy predicts the next copied token
    return tokens, targets


def read_text(path: str, seq_len: int, *, test: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The file at `path` as byte sequences of `seq_len` (int64 [N, seq_len]) and their next bytes: windows of
    seq_len + 1 bytes side by side, from the first 90 % of the file (or, `test`, the rest)."""
    import torch

    data = read_bytes(path)
    cut = int(len(data) * (1 - TEST_SHARE))
    part = torch.frombuffer(bytearray(data[cut:] if test else data[:cut]), dtype=torch.uint8).long()
    n = (len(part) - 1) // seq_len
    if n < 1:
        what = "test split (its last 10 %)" if test else "training split"
        raise ConfigError(
            f"--data-file: {path}'s {what} holds {len(part)} bytes, fewer than one sequence of --seq-len {seq_len} "
            f"and its next byte; use a longer file or a shorter --seq-len"
        )
    windows = part[: n * seq_len + 1]
    return windows[:-1].view(n, seq_len), windows[1:].view(n, seq_len)


def read_bytes(path: str) -> bytes:
    """The file's bytes, or one line of error: missing, unreadable, empty, or not text (a NUL byte or invalid
    UTF-8 in its first megabyte)."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data-file: {path} is not a file; give the path of a text file to train on")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"--data-file: cannot read {path}: {e.strerror}") from None
    if not data:
        raise ConfigError(f"--data-file: {path} is empty; give a text file with something to learn")
    head = data[: 1 << 20]
    try:
        binary = b"\0" in head or not head.decode("utf-8", errors="strict")
    except UnicodeDecodeError as e:
        binary = e.start < len(head) - 3  # (a character cut at the megabyte's end is not binary)
    if binary:
        raise ConfigError(f"--data-file: {path} is not text (NUL bytes or invalid UTF-8); give a text file")
    return data
