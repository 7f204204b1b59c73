"""Gradient clipping by the global L2 norm of the whole model's gradients, whatever holds them: each rank sums
the squares of what it holds, the sums are added over the process groups whose ranks hold *different* parts of
the model (the strategy's choice, in each script), and every rank scales by the same factor. Adding over
copies, or not adding over shards, gets the norm wrong by sqrt(copies) or sqrt(shards): docs/training.md.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from common.distributed import collective_device, local_part


@torch.no_grad()
def clip_grad_norm(
    params: Iterable[torch.nn.Parameter], max_norm: float, *, groups: Sequence[dist.ProcessGroup] = ()
) -> float:
    """Scale the gradients of `params` so that their global L2 norm is at most `max_norm` (0: measure only),
    and return the norm before clipping. `groups`: the process groups whose ranks hold different gradients.
    Every rank of those groups must call this, also one that holds no gradients."""
    grads = [local_part(p.grad) for p in params if p.grad is not None]
    device = collective_device() if dist.is_initialized() else torch.device("cpu")
    sum_sq = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:  # fp32 accumulation whatever the gradients' dtype (bf16 gradients lose digits in a sum)
        sum_sq += torch.linalg.vector_norm(g, dtype=torch.float32).to(device).square()
    for group in groups:
        dist.all_reduce(sum_sq, op=dist.ReduceOp.SUM, group=group)
    total = sum_sq.sqrt()
    if max_norm > 0:
        # torch.nn.utils.clip_grad_norm_'s factor: max_norm / (norm + 1e-6), never above 1; a tensor, so no
        # host sync is needed before the gradients are scaled
        scale = (max_norm / (total + 1e-6)).clamp(max=1.0)
        for g in grads:
            g.mul_(scale.to(g.device, g.dtype))
    return total.item()
