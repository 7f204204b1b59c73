"""Data sets as tensors (uint8 images [N, C, H, W], int64 labels [N]: the built-in digits, or a torchvision set;
BabyGPT's int64 tokens [N, T] and next tokens [N, T]: common/language.py), and the global-batch sampler that gives every
strategy the same batches: index lists, normalised on the device (docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import BATCH_TOO_BIG, Config
from common.errors import ConfigError


@dataclass
class Split:
    images: torch.Tensor  # uint8 [N, C, H, W]; a language's tokens, int64 [N, T]
    labels: torch.Tensor  # int64 [N]; a language's next tokens, int64 [N, T] (-100: not scored)

    def __len__(self) -> int:
        return len(self.labels)


@dataclass
class DataSet:
    name: str
    train: Split
    test: Split
    num_classes: int
    mean: tuple[float, ...]  # per channel, of images scaled to [0, 1]
    std: tuple[float, ...]

    @property
    def tokens(self) -> bool:
        """A language's sequences (BabyGPT's), not images."""
        return self.train.images.dtype == torch.int64

    @property
    def in_channels(self) -> int:
        return self.train.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.train.images.shape[-1]

    @property
    def shape(self) -> dict[str, int]:
        """What the model must know of the images (or the sequences): `build_model(..., **data.shape)`."""
        if self.tokens:
            return {"vocab_size": self.num_classes, "seq_len": self.train.images.shape[1]}
        return {"in_channels": self.in_channels, "image_size": self.image_size, "num_classes": self.num_classes}


# Fixed normalisation constants, so that every process normalises with bit-identical numbers.
NORMALISATION = {
    "digits": ((0.2196,), (0.3031,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "copy": ((), ()),  # tokens are not normalised
    "text": ((), ()),
}


def load_dataset(cfg: Config, *, download: bool = False) -> DataSet:
    """The data set of --dataset (with --seed, --train-size, --test-size for the built-in one, --data-dir for the
    others). `download` lets torchvision fetch a missing set: one process only (the runners' preflight)."""
    mean, std = NORMALISATION[cfg.dataset]
    if cfg.dataset in ("copy", "text"):  # BabyGPT's sequences
        from common.language import load_sequences

        train, test, vocab = load_sequences(cfg)
        return DataSet(cfg.dataset, Split(*train), Split(*test), vocab, mean, std)
    if cfg.dataset == "digits":  # each source is imported when it is chosen
        from common.digits import make_digits

        train, test = (
            make_digits(n, seed=cfg.seed, test=t) for n, t in ((cfg.train_size, False), (cfg.test_size, True))
        )
    else:
        from common.data_files import read_split

        train, test = (read_split(cfg.dataset, cfg.data_dir, train=t, download=download) for t in (True, False))
    return DataSet(cfg.dataset, Split(*train), Split(*test), 10, mean, std)


def to_device_batch(
    split: Split, indices: torch.Tensor, data: DataSet, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather `indices` from `split` and return a normalised (images, labels) pair on `device`. On CUDA the gathered
    uint8 batch is pinned, so the host-to-device copy is asynchronous and the CPU can prepare the next step while it
    runs; images travel as uint8 (4x fewer bytes) and are normalised on the GPU."""
    images, labels = split.images[indices], split.labels[indices]
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    if data.tokens:
        return images, labels  # a language's tokens: no normalising
    mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
    return (images.float() / 255 - mean) / std, labels


def blank_batch(data: DataSet, n: int, device: torch.device) -> torch.Tensor:
    """`n` inputs of the model's shape and dtype, zeros (a throwaway step's): images, or a language's tokens."""
    return torch.zeros(n, *data.train.images.shape[1:], device=device, dtype=torch.long if data.tokens else None)


class GlobalBatchSampler:
    """Which samples form the global batch of each optimizer step, whatever the world size or strategy. Epoch
    e = (step - 1) // steps_per_epoch is a permutation drawn from (seed, e), cut into consecutive global batches; a
    data-parallel rank takes a contiguous slice. A function of the step alone: no `set_epoch` to forget
    (DistributedSampler's trap), and a resume at step s needs only s. The last n % global_batch_size samples of each
    epoch's permutation sit out that epoch (different ones every epoch)."""

    def __init__(self, n_samples: int, global_batch_size: int, *, seed: int) -> None:
        if global_batch_size > n_samples:
            raise ConfigError(f"--batch-size: {BATCH_TOO_BIG.format(global_batch_size, n_samples)}")
        self.n_samples = n_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.steps_per_epoch = n_samples // global_batch_size
        self.left_out_per_epoch = n_samples % global_batch_size
        self._epoch, self._perm = -1, torch.empty(0, dtype=torch.int64)

    def epoch_of(self, step: int) -> int:
        return (step - 1) // self.steps_per_epoch

    def permutation(self, epoch: int) -> torch.Tensor:
        if epoch != self._epoch:
            generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n_samples, generator=generator)
        return self._perm

    def global_batch(self, step: int) -> torch.Tensor:
        position = (step - 1) % self.steps_per_epoch
        start = position * self.global_batch_size
        return self.permutation(self.epoch_of(step))[start : start + self.global_batch_size]

    def rank_batch(self, step: int, rank: int, world_size: int) -> torch.Tensor:
        """This rank's contiguous share of step `step`'s global batch (world_size must divide it)."""
        per_rank = self.global_batch_size // world_size
        return self.global_batch(step)[rank * per_rank : (rank + 1) * per_rank]


def describe_data(data: DataSet, sampler: GlobalBatchSampler, *, split: str, steps: int) -> str:
    """The start-up lines: the data set, how each global batch is split (`split`), the run's length, and the
    samples that sit out each epoch, if any."""
    left_out = sampler.left_out_per_epoch
    sit_out = f"\nnote: {left_out} samples per epoch do not fill a global batch and sit out that epoch"
    note = f"{sit_out} (different ones each epoch)" if left_out else ""
    what = f"sequences of {data.train.images.shape[1]} tokens" if data.tokens else "images"
    return (
        f"{data.name}: {len(data.train)} train / {len(data.test)} test {what} | "
        f"global batch {sampler.global_batch_size} = {split} | {steps} steps{note}"
    )


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Contiguous, balanced share of n items for `rank` (sizes differ by at most one; may be empty)."""
    return range(n * rank // world_size, n * (rank + 1) // world_size)


def longest_shard(n: int, world_size: int) -> int:
    """The size of the largest shard_range of n items (rank 0's is the smallest)."""
    return -(-n // world_size)
