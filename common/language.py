"""BabyGPT's data (--model gpt): sequences of tokens and, for each position, the token the model should predict
next (-100 where nothing can be predicted: the loss and the accuracy skip it). Two sources, as tensors like the
images' (docs/language.md):

* `recall` (built in, the default): associative recall. A sequence lists key-value pairs, then asks for keys again;
  the answer to each is the value that followed the key earlier. Nothing but the context tells it, so a longer
  --seq-len means more to remember, and the score reads directly: the share of answers predicted exactly.
* `text` (--data-file PATH): any text file as bytes (a vocabulary of 256), cut into sequences by position, the
  first 90 % for training and the rest for testing; every next byte is a target.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from common.errors import ConfigError

if TYPE_CHECKING:
    from common.config import Config

RECALL_KEYS = 64  # keys are tokens 0..63, values 64..127
RECALL_VOCAB = 2 * RECALL_KEYS
BYTE_VOCAB = 256
IGNORE = -100  # F.cross_entropy's ignore_index: a position whose next token is not a question's answer
TEST_SHARE = 0.1  # --data-file: the last 10 % of the file is the test split


def load_sequences(cfg: Config) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], int]:
    """The training and test splits of --dataset recall or text, as (tokens, next tokens), and the vocabulary: the
    model's (a published shape's own is larger than the data's)."""
    from common.model_sizes import gpt_vocab

    if cfg.dataset == "recall":
        sizes = ((cfg.train_size, False), (cfg.test_size, True))
        train, test = (make_recall(n, cfg.seq_len, seed=cfg.seed, test=t) for n, t in sizes)
    else:
        train, test = (read_text(cfg.data_file, cfg.seq_len, test=t) for t in (False, True))
    return train, test, gpt_vocab(cfg.model_size, cfg.dataset)


def recall_layout(seq_len: int) -> tuple[int, int]:
    """(pairs, queries) of a recall sequence of `seq_len` tokens: up to 64 distinct key-value pairs in the first
    half of the sequence (a quarter at most), then questions filling the rest, each a key and its value."""
    pairs = min(seq_len // 4, RECALL_KEYS)
    return pairs, seq_len // 2 - pairs


def make_recall(n: int, seq_len: int, *, seed: int, test: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`n` associative-recall sequences (int64 [n, seq_len]) and their targets: k1 v1 k2 v2 .. kP vP q1 a1 .. qQ aQ,
    where each q is one of the P keys and a its value; the target at each q's position is a, -100 elsewhere. The
    same for a seed on every rank; the test split from its own stream."""
    generator = torch.Generator().manual_seed(seed * 2 + int(test) + 7_919)
    pairs, queries = recall_layout(seq_len)
    keys = torch.rand(n, RECALL_KEYS, generator=generator).argsort(dim=1)[:, :pairs]  # distinct within a sequence
    values = torch.randint(RECALL_KEYS, RECALL_VOCAB, (n, pairs), generator=generator)
    asked = torch.randint(0, pairs, (n, queries), generator=generator)
    questions, answers = keys.gather(1, asked), values.gather(1, asked)
    tokens = torch.cat([torch.stack([keys, values], 2).flatten(1), torch.stack([questions, answers], 2).flatten(1)], 1)
    targets = torch.full_like(tokens, IGNORE)
    targets[:, 2 * pairs :: 2] = answers  # at a question's position: the answer that follows it
    return tokens, targets


def read_text(path: str, seq_len: int, *, test: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The file at `path` as byte sequences of `seq_len` (int64 [N, seq_len]) and their next bytes: windows of
    seq_len + 1 bytes side by side, from the first 90 % of the file (or, `test`, the rest)."""
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
