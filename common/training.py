"""Pieces of the training loop that are the same in every strategy: optimizer, learning rate, loss
reduction, evaluation and the description of a run. What differs between strategies stays in the scripts."""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import Config
from common.data import DataSet, Split, longest_shard, shard_range, to_device_batch
from common.distributed import DistEnv


def build_optimizer(params: Iterable[torch.nn.Parameter], cfg: Config) -> torch.optim.Optimizer:
    params = list(params)
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9, weight_decay=cfg.weight_decay)
    # fused: one kernel per parameter tensor instead of a dozen elementwise passes over memory (CPU and CUDA;
    # python -m bench measures what it gains)
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)


def lr_at(step: int, cfg: Config, *, last_step: int = 0) -> float:
    """The learning rate of optimizer step `step` (1-based) of a run of `last_step` steps: linear warm-up to
    --lr over --warmup-steps, then constant, or a cosine or linear decay that reaches --min-lr exactly at
    `last_step`. A function of the step alone, so a resumed or restarted run and every strategy agree."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return cfg.lr * step / cfg.warmup_steps
    if cfg.lr_schedule == "constant" or last_step <= cfg.warmup_steps:
        return cfg.lr
    progress = min(step - cfg.warmup_steps, last_step - cfg.warmup_steps) / (last_step - cfg.warmup_steps)
    # written as min_lr + (lr - min_lr) * f with f exactly 0 at the last step (cos(pi) is exactly -1), so
    # the last step's rate is --min-lr to the bit, not a rounding of it
    f = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.lr_schedule == "cosine" else 1 - progress
    return cfg.min_lr + (cfg.lr - cfg.min_lr) * f


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def autocast(cfg: Config, device: torch.device):
    """bf16 autocast for --precision bf16 (matmuls and convolutions in bf16, reductions in fp32)."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.precision == "bf16")


def global_mean(value: torch.Tensor, group: dist.ProcessGroup | None = None) -> float:
    """Mean of a per-rank scalar over all ranks of `group`: each rank's loss is the mean over an equal
    share of the global batch, so the mean of the rank means is the mean over the whole global batch."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=group)
    return value.item() / dist.get_world_size(group)


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at step {step}; lower --lr or use --precision fp32")


@torch.no_grad()
def evaluate(
    forward: Callable[[torch.Tensor], torch.Tensor],
    split: Split,
    data: DataSet,
    *,
    rank: int,
    world_size: int,
    device: torch.device,
    batch_size: int = 500,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, float]:
    """(test loss, test accuracy) over the whole of `split`.

    Each rank evaluates its contiguous shard; sums of losses and hits are reduced across ranks, so the
    result is the same for any world size. Every rank makes the same number of forward calls (a rank with
    a shorter shard runs an empty batch), because sharded models (FSDP) communicate inside forward.
    """
    shard = shard_range(len(split), rank, world_size)
    longest = longest_shard(len(split), world_size)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, hits, count
    for start in range(0, max(longest, 1), batch_size):
        indices = torch.arange(shard.start + start, min(shard.start + start + batch_size, shard.stop))
        images, labels = to_device_batch(split, indices, data, device, dtype)
        logits = forward(images).float()
        totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
        totals[1] += (logits.argmax(dim=1) == labels).sum()
        totals[2] += len(labels)
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    loss_sum, hits, count = totals.tolist()
    return loss_sum / count, hits / count


def describe_run(cfg: Config, env: DistEnv, **extra: Any) -> dict[str, Any]:
    """The identity of a run, for run.json: what ran, where, and with which settings."""
    return {
        "strategy": cfg.strategy,
        "world_size": env.world_size,
        "backend": env.backend,
        "device": env.device.type,
        "torch_version": torch.__version__,
        "threads_per_process": torch.get_num_threads() if env.device.type == "cpu" else None,
        "config": cfg.flags(),
        **extra,
    }


def gather_memory(memory: dict[str, Any], rank: int) -> list[dict[str, Any]]:
    """Every rank's memory record, in rank order (all ranks must call this)."""
    records: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(records, {"rank": rank, **memory})
    return records
