"""What each rank sends and receives per optimizer step, by collective. Each script predicts its own from the
model and the mesh (`*_traffic` in train_*.py; run.json "traffic"); --profile-steps counts the same elements from
the collectives the profiler saw (run.json "profile", per rank). docs/communication.md explains the numbers.

Bytes are those of the ring algorithms that nccl-tests' bus bandwidth assumes: over n ranks an all-reduce of S
bytes sends and receives 2 (n - 1) / n S per rank, an all-gather (S: what is gathered) and a reduce-scatter (S:
what is reduced) (n - 1) / n S; a point-to-point send moves S. No torch here: the arithmetic only.
"""

from __future__ import annotations

Traffic = dict[str, dict[str, float]]  # collective -> {"elements", "bytes", "bytes_sent", "bytes_received"}

RING_SHARE = {  # what share of the collective's size each of n ranks sends (and receives), by the ring
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def add(traffic: Traffic, kind: str, *, elements: int, itemsize: int, ranks: int = 2, times: int = 1) -> Traffic:
    """Count `times` collectives of `kind` (all_reduce, all_gather, reduce_scatter over `ranks`; send; recv) on
    tensors of `elements` elements of `itemsize` bytes into `traffic`; returns it. "bytes" is their size as
    nccl-tests counts it, "bytes_sent" and "bytes_received" what this rank moves."""
    entry = traffic.setdefault(kind, {"elements": 0, "bytes": 0, "bytes_sent": 0, "bytes_received": 0})
    size = elements * itemsize * times
    entry["elements"] += elements * times
    entry["bytes"] += size
    if kind in RING_SHARE:
        entry["bytes_sent"] += RING_SHARE[kind](ranks) * size
        entry["bytes_received"] += RING_SHARE[kind](ranks) * size
    else:
        entry["bytes_sent" if kind == "send" else "bytes_received"] += size
    return traffic


def padded_shard(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one FSDP2 shard of a parameter of `shape`: dim 0 cut in `shards` equal rows, the last ones
    padded (so every rank's shard, and the all-gather's buffer, has the same size)."""
    rest = 1
    for size in shape[1:]:
        rest *= size
    return -(-shape[0] // shards) * rest if shape else 1


def total_bytes(traffic: Traffic) -> float:
    return sum(entry["bytes_sent"] for entry in traffic.values())
