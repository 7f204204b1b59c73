"""Ring attention, written out: context parallelism's attention over point-to-point sends (train_cp.py).

Each of the cp ranks of a ring holds 1/cp of every sequence: the sequence is cut into 2 cp chunks and rank r
holds chunk r and chunk 2 cp - 1 - r (a head and a tail), so that under a causal mask every rank has the same work.
Its queries must meet every rank's keys and values. In cp steps each rank computes its queries against the
key/value chunk it holds, hands that chunk to the next rank and takes the previous rank's, the next transfer
started before the current chunk is computed (on a GPU they overlap). The partial outputs are merged by their
log-sum-exp, as flash attention merges its tiles. Backward goes round again: the keys and values travel as
before, and with them their gradients, each rank adding its share, until they come home (docs/context-parallel.md).

    ring = RingAttention(cp_group)          # one per process: which ring, which rank in it
    x_local = ring.shard(x)                 # [B, T] -> [B, T / cp], this rank's head and tail chunks
    y = ring(q, k, v)                       # q [B, H, T / cp, D], k, v [B, H_kv, T / cp, D]: causal over all T

The attention of one chunk against another is torch's own kernel (flash attention on the CPU, memory-efficient
attention on CUDA), called with its log-sum-exp: the ring and the merge are what this file adds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


class RingAttention:
    """Causal attention over the ranks of `group`, each holding a head and a tail chunk of every sequence."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size, self.rank = group, dist.get_world_size(group), dist.get_rank(group)
        self.right = dist.get_global_rank(group, (self.rank + 1) % self.size)  # where this rank's chunk goes next
        self.left = dist.get_global_rank(group, (self.rank - 1) % self.size)  # where the next chunk comes from

    def positions(self, length: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """The global positions of this rank's `length` tokens (a sequence of length x cp): its head chunk r and
        its tail chunk 2 cp - 1 - r. Rotary positions and the data are cut by them."""
        return _positions(length, self.rank, self.size).to(device)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of `x` (cut along `dim`, the sequence): [B, T] -> [B, T / cp]."""
        return x.index_select(dim, self.positions(x.shape[dim] // self.size, x.device))

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """Every rank's tokens of `x`, put back in sequence order: the inverse of `shard` (evaluation's logits)."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        every = torch.cat(parts, dim)  # rank 0's head and tail, rank 1's, ...
        order = torch.cat([_positions(x.shape[dim], r, self.size) for r in range(self.size)]).to(x.device)
        return torch.empty_like(every).index_copy_(dim, order, every)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence's keys and values (the ring's)."""
        return _RingAttention.apply(q, k, v, self)

    def exchange(self, send: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Start sending `send` to the right and receiving its like from the left; (what arrives, the requests)."""
        arriving = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.right, self.group),
            dist.P2POp(dist.irecv, arriving, self.left, self.group),
        ]
        return arriving, dist.batch_isend_irecv(ops)


class BuiltinRing(RingAttention):
    """--cp-attention torch: the same chunks and positions, and attention by F.scaled_dot_product_attention, which
    torch's own context parallelism (train_cp.py enters it; CUDA kernels only) runs as its ring."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, _expand(k, groups), _expand(v, groups), is_causal=True)


def _positions(length: int, rank: int, size: int) -> torch.Tensor:
    """Global positions of rank `rank`'s `length` tokens in a ring of `size`: chunks rank and 2 size - 1 - rank."""
    c = length // 2
    head, tail = torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * size - 1 - rank) * c, (2 * size - rank) * c)
    return torch.cat([head, tail])


def _wait(requests: list) -> None:
    for request in requests:
        request.wait()


def _blocks(rank: int, source: int) -> tuple[str, str, bool]:
    """Which of this rank's queries meet which of `source`'s keys ("all", "head" or "tail"), and whether causally.
    Rank r holds chunks r and 2 cp - 1 - r. Its own keys: all against all, causal (in local order, head before
    tail, that is the global mask). An earlier rank's: its head comes before both of this rank's chunks, its tail
    after both, so all queries against its head. A later rank's: both its chunks come after this rank's head and
    before its tail, so the tail's queries against all. Each is half of all against all: equal work everywhere."""
    if source == rank:
        return "all", "all", True
    return ("all", "head", False) if source < rank else ("tail", "all", False)


def _part(length: int, which: str) -> slice:
    """The tokens `which` names, of a rank's `length`: all, its head chunk or its tail chunk."""
    return {"all": slice(None), "head": slice(0, length // 2), "tail": slice(length // 2, None)}[which]


def _cut(x: torch.Tensor, which: str) -> torch.Tensor:
    """x [B, H, T, ...] along its tokens (dim 2): all, the head chunk or the tail chunk."""
    return x[:, :, _part(x.shape[2], which)]


def _expand(kv: torch.Tensor, groups: int) -> torch.Tensor:
    """Grouped key/value heads repeated for their query heads ([B, H_kv, T, D] -> [B, H, T, D])."""
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _fold(grad: torch.Tensor, groups: int) -> torch.Tensor:
    """The gradient of repeated key/value heads, summed over each head's `groups` copies (_expand's backward)."""
    return grad.unflatten(1, (-1, groups)).sum(2) if groups > 1 else grad


def _forward_block(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp [B, H, Tq] in fp32) of softmax(q k^T / sqrt(D)) v, by torch's fused kernel."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if q.device.type == "cuda":  # memory-efficient attention: fp32, fp16 and bf16; its log-sum-exp may be padded
        out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)
        return out, lse[..., : q.shape[2]].float()
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    return out, lse.float()


def _backward_block(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one block, given the merged output and log-sum-exp of the queries' whole rows: with them a
    block's softmax is its share of the row's, and the blocks' gradients add up to the whole attention's."""
    q, k, v, out, dout, lse = (t.contiguous() for t in (q, k, v, out, dout, lse))
    if q.device.type == "cuda":
        rows = lse.shape[-1] if torch.version.hip else -(-lse.shape[-1] // 32) * 32  # the kernel's: 32 rows a tile
        padded = lse.new_zeros(*lse.shape[:-1], rows)
        padded[..., : lse.shape[-1]] = lse
        seed = torch.zeros((), dtype=torch.int64, device=q.device)  # no dropout: no random state to replay
        dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, padded, seed, seed, 0.0, [True, True, True, False], causal
        )
        return dq, dk, dv
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(dout, q, k, v, out, lse, 0.0, causal)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingAttention) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        out = q.new_zeros(q.shape, dtype=torch.float32)  # merged in fp32, whatever q's dtype
        lse = q.new_full(q.shape[:3], float("-inf"), dtype=torch.float32)
        kv = torch.stack([k, v])  # one message a step: this rank's keys and values, unrepeated (GQA's fewer heads)
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size  # whose chunk this rank holds now
            if step < ring.size - 1:
                arriving, requests = ring.exchange(kv)  # the next chunk moves while this one is computed
            rows, cols, causal = _blocks(ring.rank, source)
            keys, values = (_cut(_expand(t, groups), cols) for t in kv)
            block_out, block_lse = _forward_block(_cut(q, rows), keys, values, causal)
            # the merge: the rows' log-sum-exp over both, and each output weighted by its share of it
            r = _part(q.shape[2], rows)
            merged_lse = torch.logaddexp(lse[:, :, r], block_lse)
            out[:, :, r] = (
                out[:, :, r] * (lse[:, :, r] - merged_lse).exp()[..., None]
                + block_out.float() * (block_lse - merged_lse).exp()[..., None]
            )
            lse[:, :, r] = merged_lse
            if step < ring.size - 1:
                _wait(requests)
                kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        q, k, v, out, lse = ctx.saved_tensors
        ring: RingAttention = ctx.ring
        groups = q.shape[1] // k.shape[1]
        dq = q.new_zeros(q.shape, dtype=torch.float32)
        kv = torch.stack([k, v])
        dkv = kv.new_zeros(kv.shape, dtype=torch.float32)  # travels with kv, each rank adding its share
        passing: list = []  # the previous step's gradient transfer, waited for only when its sum is needed
        for step in range(ring.size):
            source = (ring.rank - step) % ring.size
            if step < ring.size - 1:
                arriving, requests = ring.exchange(kv)
            rows, cols, causal = _blocks(ring.rank, source)
            keys, values = (_cut(_expand(t, groups), cols) for t in kv)
            r, c = _part(q.shape[2], rows), _part(k.shape[2], cols)
            dq_b, dk_b, dv_b = _backward_block(
                dout[:, :, r], q[:, :, r], keys, values, out[:, :, r], lse[:, :, r], causal
            )
            dq[:, :, r] += dq_b.float()
            _wait(passing)  # this chunk's gradient so far, sent on by the previous rank while the block was computed
            dkv[0][:, :, c] += _fold(dk_b.float(), groups)
            dkv[1][:, :, c] += _fold(dv_b.float(), groups)
            if ring.size > 1:  # the chunk's gradient follows the chunk; after the last step it is home (one: it is)
                dkv, passing = ring.exchange(dkv)
            if step < ring.size - 1:
                _wait(requests)
                kv = arriving
        _wait(passing)
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None
