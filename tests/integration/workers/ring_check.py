"""The hand-written ring against dist.all_reduce, on real ranks (tests/integration/workers/runs.py calls it).

Every length from 1 to a few thousand that does and does not divide by the world size, integers (must be equal)
and floats (equal to rounding: the ring adds in another order), over the whole world and over a sub-group.
Rank 0 writes what it found to out/ring.json.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist

from common.ring import ring_all_reduce


def compare(length: int, dtype: torch.dtype, group) -> dict:
    generator = torch.Generator().manual_seed(1000 * length + dist.get_rank())  # each rank its own numbers
    x = (torch.randn(length, generator=generator) * 1000).to(dtype)
    ring, builtin = ring_all_reduce(x.clone(), group), x.clone()
    dist.all_reduce(builtin, group=group)
    return {
        "equal": bool(torch.equal(ring, builtin)),
        "max_rel": float(((ring - builtin).abs().max() / builtin.abs().max().clamp_min(1e-30)).item()),
    }


def check_ring(env, out: Path) -> None:
    n = env.world_size
    lengths = sorted({1, n - 1 or 1, n, n + 1, 7 * n, 7 * n + 3, 1000, 4099})
    found = {"world": n, "lengths": lengths, "whole": {}, "evens": {}}
    evens = dist.new_group(list(range(0, n, 2)))  # every rank calls new_group; the even ones use it
    for dtype in (torch.int64, torch.float32):
        found["whole"][str(dtype)] = [compare(length, dtype, None) for length in lengths]
        if env.rank % 2 == 0 and n > 2:
            found["evens"][str(dtype)] = [compare(length, dtype, evens) for length in lengths]
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "ring.json").write_text(json.dumps(found))
