"""Ring attention (common/ring_attention.py) against torch's attention over the whole sequence, on real ranks.

    torchrun --standalone --nproc-per-node 4 tests/integration/workers/ring_attention_check.py --out DIR

One launch checks rings of 4 (the world), of 2 (ranks 0-1 and 2-3: a ring whose ranks are not the world's first
ones) and of 1 (every rank alone, as `python train_cp.py` runs). Every rank builds the same whole q, k, v and output
gradient; the reference is F.scaled_dot_product_attention(is_causal=True) with the key/value heads repeated for
their query heads (GQA) on the whole sequence, and each rank of a ring holds only its head and tail chunk of it.
Each rank records the positions it holds, how far its output and its dq, dk, dv are from its chunks of the
reference's, and whether ring.gather(ring.shard(x)) gives back x exactly; rank 0 writes every rank's findings to
DIR/ring_attention.json for tests/integration/test_cp.py to assert on (the checks are the test's, not the worker's).
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.distributed import run, setup_distributed, teardown_distributed
from common.ring_attention import RingAttention

# 8 query heads sharing 4 key/value heads in pairs (GQA); 64 tokens cut into 2 x 4 chunks of 8 on a ring of 4
BATCH, HEADS, KV_HEADS, SEQ_LEN, HEAD_DIM = 2, 8, 4, 64, 16


def whole_inputs(seed: int) -> dict[str, torch.Tensor]:
    """The same q, k, v and output gradient on every rank (a generator of its own: the ranks' global RNG differ)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, SEQ_LEN, HEAD_DIM, generator=g)
    k, v = (torch.randn(BATCH, KV_HEADS, SEQ_LEN, HEAD_DIM, generator=g) for _ in range(2))
    return {"q": q, "k": k, "v": v, "dout": torch.randn(BATCH, HEADS, SEQ_LEN, HEAD_DIM, generator=g)}


def reference(x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Causal attention over the whole sequence by torch, and the gradients of q, k, v (unrepeated k, v)."""
    q, k, v = (x[name].clone().requires_grad_() for name in ("q", "k", "v"))
    groups = HEADS // KV_HEADS
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1), is_causal=True
    )
    out.backward(x["dout"])
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def check(ring: RingAttention, seed: int) -> dict:
    """This rank's findings in `ring`: its positions, the largest differences from the reference, the round trip."""
    x = whole_inputs(seed)
    expected = reference(x)
    q, k, v = (ring.shard(x[name], dim=2).requires_grad_() for name in ("q", "k", "v"))  # [B, H, T / cp, D]
    out = ring(q, k, v)
    out.backward(ring.shard(x["dout"], dim=2))
    found = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    diffs = {name: float((found[name] - ring.shard(expected[name], dim=2)).abs().max()) for name in found}
    scale = {name: float(expected[name].abs().max()) for name in expected}  # (the differences are of values this big)
    tokens = torch.arange(3 * SEQ_LEN).reshape(3, SEQ_LEN)  # [B, T] as the data is: dim 1
    return {
        "ring": [dist.get_global_rank(ring.group, r) for r in range(ring.size)],
        "size": ring.size,
        "rank": ring.rank,
        "positions": ring.positions(SEQ_LEN // ring.size).tolist(),
        "shard_tokens": ring.shard(tokens).tolist(),
        "max_abs_diff": diffs,
        "max_abs": scale,
        # every rank's output put back in sequence order: the whole sequence's attention
        "gathered_out_diff": float((ring.gather(found["out"], dim=2) - expected["out"]).abs().max()),
        "round_trip_tokens": bool(torch.equal(ring.gather(ring.shard(tokens)), tokens)),
        "round_trip_heads": bool(torch.equal(ring.gather(ring.shard(x["q"], dim=2), dim=2), x["q"])),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    env = setup_distributed(timeout_s=120)
    try:
        n = env.world_size
        # every rank calls new_group for every group, in the same order; each uses the one it is in
        pairs = [dist.new_group([r, r + 1]) for r in range(0, n - 1, 2)]
        alone = [dist.new_group([r]) for r in range(n)]
        rings = {"world": RingAttention(dist.group.WORLD)}
        if n % 2 == 0:
            rings["pairs"] = RingAttention(pairs[env.rank // 2])
        rings["alone"] = RingAttention(alone[env.rank])  # (last: its error, if any, is recorded, not raised)
        mine = {}
        for seed, (name, ring) in enumerate(rings.items()):
            try:
                mine[name] = check(ring, seed)
            except RuntimeError as error:  # a ring that cannot run is a finding; the others still report theirs
                mine[name] = {"error": str(error).splitlines()[0]}
        every = [None] * n
        dist.all_gather_object(every, mine)
        if env.rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            (out / "ring_attention.json").write_text(json.dumps({"world": n, "ranks": every}))
    finally:
        teardown_distributed()


if __name__ == "__main__":
    run(main)
