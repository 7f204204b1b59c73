"""Gradient clipping by the global L2 norm of the whole model's gradients, whatever holds them: each rank sums the
squares of what it holds, the sums are added over the ranks that hold *different* parts (a DTensor says over
which mesh dims it is sharded; a pipeline's stages, the caller's `groups`), and every rank scales alike
(docs/training.md)."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from common.distributed import collective_device


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.nn.Parameter],
    max_norm: float,
    *,
    groups: Sequence[dist.ProcessGroup] = (),
    loss_scale: float = 1.0,
) -> float:
    """Scale the gradients of `params` so that their global L2 norm is at most `max_norm` (0: measure only),
    and return the norm before clipping. `groups`: process groups whose ranks hold different parameters (not
    shards of the same DTensors). Every rank of those groups must call this, also one that holds no gradients.
    `loss_scale`: the loss was multiplied by it (fp16), so the gradients are divided by it here, and the norm
    returned is the true one (inf or nan if any rank's gradients overflowed)."""
    device = collective_device() if dist.is_initialized() else torch.device("cpu")
    # a sum of squares per set of groups to add it over, in the parameters' order (the same on every rank)
    sums: dict[tuple, torch.Tensor] = {}
    grads = []
    for g in (p.grad for p in params if p.grad is not None):
        sharded_over = ()
        if hasattr(g, "placements"):  # a DTensor; not is_shard(): FSDP x TP's _StridedShard is none (torch 2.14.1)
            assert not any(kind.is_partial() for kind in g.placements), "clip after the gradients are reduced"
            dims = [d for d, kind in enumerate(g.placements) if not kind.is_replicate()]
            sharded_over, g = tuple(g.device_mesh.get_group(d) for d in dims), g.to_local()
        grads.append(g)
        acc = sums.setdefault(sharded_over, torch.zeros((), dtype=torch.float64, device=device))
        # Never in the gradients' dtype (bf16 loses digits). On a CPU in fp64: the CPU kernel is 1e-4 off
        # in fp32 for fc1's million elements (pytorch/pytorch#169237), more than the strategies differ by.
        dtype = torch.float64 if g.device.type == "cpu" else torch.float32
        acc += torch.linalg.vector_norm(g, dtype=dtype).to(device, torch.float64).square()
    for sharded_over, acc in sums.items():
        for group in sharded_over:  # e.g. FSDP x TP: a split layer over "dp" and "tp", a replicated one over "dp"
            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)
    sum_sq = sum(sums.values(), torch.zeros((), dtype=torch.float64, device=device))
    for group in groups:
        dist.all_reduce(sum_sq, op=dist.ReduceOp.SUM, group=group)
    total = sum_sq.sqrt() / loss_scale  # exact: the loss scale is a power of two
    if max_norm > 0 or loss_scale != 1:
        # torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1; a tensor, so no
        # host sync is needed before the gradients are scaled. Unscaling rides along: one pass over them.
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0) if max_norm > 0 else torch.ones_like(total)
        for g in grads:
            g.mul_((scale / loss_scale).to(g.device, g.dtype))
    return total.item()
