"""The built-in data set, `digits`: ten digit shapes drawn as strokes, rendered once, then varied per image in
position, scale, rotation, shear, stroke width, local distortion, contrast and noise. No file, no network,
about a second to build, and a pure function of (n, seed, split): identical on every rank.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


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


def make_digits(n: int, *, seed: int, test: bool = False, size: int = 28) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 images [n, 1, size, size], int64 labels [n]) of the built-in data set: a function of (n, seed, test)."""
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
    return (images * 255).round().to(torch.uint8), labels
