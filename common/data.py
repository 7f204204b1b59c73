"""Data sets as tensors, and the global-batch sampler that makes every strategy see the same batches.

* `digits` (the default) is built in: ten digit shapes drawn as strokes, rendered once, then varied per
  image in position, scale, rotation, shear, stroke width, local distortion, contrast and noise. It needs
  no file and no network, takes about a second to build, and is identical on every rank for a given seed.
* `mnist`, `fashion-mnist` and `cifar10` come from torchvision (imported only for them) under --data-dir.

A data set is materialised once as uint8 images [N, C, H, W] and int64 labels [N]; batches are index
lists into it, normalised on the device (`to_device_batch`), so the training loop does no per-sample work.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.config import ConfigError, batch_larger_than_data


@dataclass
class Split:
    images: torch.Tensor  # uint8 [N, C, H, W]
    labels: torch.Tensor  # int64 [N]

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
    def in_channels(self) -> int:
        return self.train.images.shape[1]

    @property
    def image_size(self) -> int:
        return self.train.images.shape[-1]


# Fixed normalisation constants, so that every process normalises with bit-identical numbers.
NORMALISATION = {
    "digits": ((0.2196,), (0.3031,)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def load_dataset(
    name: str,
    *,
    data_dir: str = "data",
    seed: int = 0,
    train_size: int = 12800,
    test_size: int = 2000,
    download: bool = False,
) -> DataSet:
    """Load a data set by name. `download` lets torchvision fetch a missing data set (one process only:
    the runners do it in their preflight, before any worker starts)."""
    mean, std = NORMALISATION[name]
    if name == "digits":
        train, test = make_digits(train_size, seed=seed), make_digits(test_size, seed=seed, test=True)
        return DataSet(name, train, test, 10, mean, std)
    from common.data_files import read_split  # the torchvision sets only

    train, test = (Split(*read_split(name, data_dir, train=t, download=download)) for t in (True, False))
    return DataSet(name, train, test, 10, mean, std)


def to_device_batch(
    split: Split, indices: torch.Tensor, data: DataSet, device: torch.device, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather `indices` from `split` and return a normalised (images, labels) pair on `device`.

    On CUDA the gathered uint8 batch is pinned, so the host-to-device copy is asynchronous and the CPU
    can prepare the next step while it runs; images travel as uint8 (4x fewer bytes) and are normalised
    on the GPU.
    """
    images, labels = split.images[indices], split.labels[indices]
    if device.type == "cuda":
        images, labels = images.pin_memory(), labels.pin_memory()
    images = images.to(device, non_blocking=True)
    labels = labels.to(device, non_blocking=True)
    mean = torch.tensor(data.mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(data.std, device=device).view(1, -1, 1, 1)
    return ((images.float() / 255 - mean) / std).to(dtype), labels


class GlobalBatchSampler:
    """Which samples form the global batch of each optimizer step.

    Step s (1-based) of the run uses the same list of `global_batch_size` indices whatever the world size
    or strategy: epoch e = (s - 1) // steps_per_epoch is a permutation drawn from (seed, e), cut into
    consecutive global batches. A data-parallel rank takes a contiguous slice of the global batch.

    Because the permutation is a function of the epoch, every epoch is shuffled differently without a
    `set_epoch` call to forget (DistributedSampler's trap), and resuming at step s needs only s.
    When the data set size is not a multiple of the global batch, the last `n % global_batch_size`
    samples of each epoch's permutation are left out of that epoch (different ones every epoch); the
    scripts say so at start-up.
    """

    def __init__(self, n_samples: int, global_batch_size: int, *, seed: int) -> None:
        if global_batch_size > n_samples:
            raise ConfigError(f"--batch-size: {batch_larger_than_data(global_batch_size, n_samples)}")
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
    line = (
        f"{data.name}: {len(data.train)} train / {len(data.test)} test images | "
        f"global batch {sampler.global_batch_size} = {split} | {steps} steps"
    )
    if sampler.left_out_per_epoch:
        line += (
            f"\nnote: {sampler.left_out_per_epoch} samples per epoch do not fill a global batch and sit out "
            f"that epoch (different ones each epoch)"
        )
    return line


def shard_range(n: int, rank: int, world_size: int) -> range:
    """Contiguous, balanced share of n items for `rank` (sizes differ by at most one; may be empty)."""
    return range(n * rank // world_size, n * (rank + 1) // world_size)


def longest_shard(n: int, world_size: int) -> int:
    """The size of the largest shard_range of n items (rank 0's is the smallest)."""
    return -(-n // world_size)


# ----------------------------------------------------------------------------- built-in digits
def _arc(cx: float, cy: float, rx: float, ry: float, start_deg: float, end_deg: float, n: int = 12):
    """Points on an elliptical arc; y grows downwards, angle 0 is to the right, -90 is up."""
    return [
        (cx + rx * math.cos(math.radians(a)), cy + ry * math.sin(math.radians(a)))
        for a in (start_deg + (end_deg - start_deg) * i / n for i in range(n + 1))
    ]


# Each digit has one or two styles; a style is a list of strokes, a stroke a polyline in the unit square.
DIGIT_STROKES: dict[int, list[list[list[tuple[float, float]]]]] = {
    0: [[_arc(0.5, 0.5, 0.26, 0.4, 0, 360, 24)], [_arc(0.5, 0.5, 0.2, 0.4, 0, 360, 24)]],
    1: [[[(0.5, 0.1), (0.5, 0.9)]], [[(0.33, 0.27), (0.52, 0.1), (0.52, 0.9)], [(0.34, 0.9), (0.7, 0.9)]]],
    2: [
        [_arc(0.5, 0.32, 0.25, 0.22, -180, 20), [(0.73, 0.4), (0.25, 0.9), (0.78, 0.9)]],
        [_arc(0.5, 0.32, 0.24, 0.22, -170, 30) + _arc(0.2, 0.45, 0.55, 0.45, -10, 90), [(0.2, 0.9), (0.8, 0.88)]],
    ],
    3: [
        [_arc(0.5, 0.3, 0.24, 0.2, -160, 90), _arc(0.5, 0.7, 0.27, 0.2, -90, 160)],
        [[(0.25, 0.1), (0.75, 0.1), (0.45, 0.45)], _arc(0.5, 0.68, 0.27, 0.22, -100, 160)],
    ],
    4: [
        [[(0.66, 0.9), (0.66, 0.1), (0.2, 0.65), (0.82, 0.65)]],
        [[(0.3, 0.1), (0.24, 0.58), (0.8, 0.58)], [(0.66, 0.3), (0.66, 0.9)]],
    ],
    5: [[[(0.76, 0.1), (0.32, 0.1), (0.28, 0.46)], _arc(0.5, 0.66, 0.27, 0.24, -125, 155)]],
    6: [
        [_arc(0.66, 0.62, 0.38, 0.52, -100, -180), _arc(0.5, 0.68, 0.22, 0.21, 0, 360, 20)],
        [[(0.68, 0.1), (0.3, 0.62)], _arc(0.5, 0.7, 0.21, 0.19, 0, 360, 20)],
    ],
    7: [[[(0.2, 0.1), (0.8, 0.1), (0.42, 0.9)]], [[(0.2, 0.12), (0.8, 0.1), (0.45, 0.9)], [(0.38, 0.5), (0.72, 0.5)]]],
    8: [[_arc(0.5, 0.29, 0.2, 0.19, 0, 360, 20), _arc(0.5, 0.7, 0.25, 0.21, 0, 360, 20)]],
    9: [
        [_arc(0.5, 0.32, 0.22, 0.21, 0, 360, 20), [(0.72, 0.32), (0.64, 0.9)]],
        [_arc(0.5, 0.32, 0.22, 0.21, 0, 360, 20), _arc(0.22, 0.32, 0.5, 0.58, 0, 80)],
    ],
}
_RENDER = 56  # prototypes are drawn at 2x and sampled down, which anti-aliases the strokes
_WIDTHS = (0.045, 0.065, 0.09)  # stroke half-widths, as a fraction of the image side


@functools.lru_cache(maxsize=1)
def _render_prototypes() -> tuple[torch.Tensor, torch.Tensor]:
    """All (digit, style, width) prototypes at _RENDER x _RENDER, and the digit of each."""
    coords = (torch.arange(_RENDER, dtype=torch.float32) + 0.5) / _RENDER
    pixels = torch.stack(torch.meshgrid(coords, coords, indexing="xy"), dim=-1).reshape(-1, 2)  # (x, y)
    images, digits = [], []
    for digit, styles in DIGIT_STROKES.items():
        for strokes in styles:
            segments = torch.tensor([[*a, *b] for line in strokes for a, b in zip(line, line[1:])])
            a, b = segments[:, :2], segments[:, 2:]
            ab = b - a
            t = ((pixels[:, None] - a) * ab).sum(-1) / (ab * ab).sum(-1).clamp_min(1e-9)
            nearest = a + t.clamp(0, 1)[..., None] * ab
            distance = (pixels[:, None] - nearest).norm(dim=-1).amin(dim=1)
            for width in _WIDTHS:
                ink = ((width - distance) * _RENDER / 1.5 + 0.5).clamp(0, 1)
                images.append(ink.view(_RENDER, _RENDER))
                digits.append(digit)
    return torch.stack(images)[:, None], torch.tensor(digits)


def make_digits(n: int, *, seed: int, test: bool = False, size: int = 28) -> Split:
    """n images of the built-in digits data set: a pure function of (n, seed, test)."""
    g = torch.Generator().manual_seed(seed * 2 + int(test) + 12345)
    prototypes, prototype_digit = _render_prototypes()
    labels = torch.randint(0, 10, (n,), generator=g)
    # pick one of the prototypes of each image's digit
    counts = torch.bincount(prototype_digit, minlength=10)
    first = torch.cumsum(counts, 0) - counts  # prototypes are grouped by digit
    proto_index = first[labels] + (torch.rand(n, generator=g) * counts[labels]).long()

    # a random affine map per image: rotation, anisotropic scale, shear, translation
    angle = (torch.rand(n, generator=g) - 0.5) * math.radians(40)
    scale_x = 0.9 + 0.4 * torch.rand(n, generator=g)
    scale_y = scale_x * (0.85 + 0.3 * torch.rand(n, generator=g))
    shear = (torch.rand(n, generator=g) - 0.5) * 0.6
    shift = (torch.rand(n, 2, generator=g) - 0.5) * 0.35
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack(
        [
            torch.stack([cos * scale_x, (-sin + shear) * scale_x, shift[:, 0]], dim=1),
            torch.stack([sin * scale_y, cos * scale_y, shift[:, 1]], dim=1),
        ],
        dim=1,
    )
    grid = F.affine_grid(theta, [n, 1, size, size], align_corners=False)
    # plus a smooth local distortion, like a hand that wobbles
    wobble = (torch.rand(n, 2, 4, 4, generator=g) - 0.5) * 0.22
    grid = grid + F.interpolate(wobble, size=(size, size), mode="bicubic", align_corners=True).permute(0, 2, 3, 1)

    images = torch.empty(n, 1, size, size)
    for start in range(0, n, 4096):  # chunks bound the memory of the gathered prototypes
        part = slice(start, start + 4096)
        images[part] = F.grid_sample(
            prototypes[proto_index[part]], grid[part], mode="bilinear", padding_mode="zeros", align_corners=False
        )
    contrast = 0.55 + 0.45 * torch.rand(n, 1, 1, 1, generator=g)
    background = 0.15 * torch.rand(n, 1, 1, 1, generator=g)
    noise = torch.randn(n, 1, size, size, generator=g) * (0.04 + 0.1 * torch.rand(n, 1, 1, 1, generator=g))
    images = (images * contrast + background * torch.rand(n, 1, size, size, generator=g) + noise).clamp(0, 1)
    return Split((images * 255).round().to(torch.uint8), labels)
