"""The training loop's pieces that every strategy shares: optimizer, learning rate, precision, loss reduction and
evaluation."""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import Config
from common.data import DataSet, longest_shard, shard_range, to_device_batch


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


def low_precision(cfg: Config) -> torch.dtype | None:
    """The dtype of --precision bf16 or fp16 (None for fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)


def autocast(cfg: Config, device: torch.device):
    """Autocast for --precision bf16 or fp16: matmuls and convolutions in that dtype, reductions in fp32."""
    return torch.autocast(device.type, dtype=low_precision(cfg) or torch.bfloat16, enabled=cfg.precision != "fp32")


class NoLossScaling:
    """fp32 and bf16 scale nothing: every step is taken. With --precision fp16, common/fp16.py's LossScaler takes its
    place (`loss_scaler`): it has these attributes and methods too, and scales."""

    enabled, skipped, value = False, False, 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss

    def step(self, optimizer: torch.optim.Optimizer | None, grad_norm: float) -> None:
        if optimizer:  # (a pipeline rank whose stages hold no parameters has none)
            optimizer.step()


def loss_scaler(cfg: Config) -> NoLossScaling:
    """What scales the loss: nothing, or with --precision fp16 a LossScaler (common/fp16.py, loaded only then)."""
    if cfg.precision != "fp16":
        return NoLossScaling()
    from common.fp16 import LossScaler

    return LossScaler(cfg)


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The mean cross-entropy: over the images' labels [B] (logits [B, classes]), or over a language's scored
    positions (logits [B, T, V], next tokens [B, T], -100 where nothing is scored). Every sequence has as many
    scored positions as any other, so the mean over a rank's share, averaged over the ranks, is the batch's mean.
    Under TP's loss_parallel the logits are split by vocabulary and the loss is computed on the shards."""
    if logits.dim() == 2:
        return F.cross_entropy(logits, labels)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))  # (ignore_index=-100: the default)


def global_mean(value: torch.Tensor) -> float:
    """Mean of a per-rank scalar over all ranks: each rank's loss is the mean over an equal share of the global
    batch, so the mean of the rank means is the mean over the whole global batch."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value.item() / dist.get_world_size()


def check_finite(loss: float, step: int) -> None:
    if not math.isfinite(loss):
        raise FloatingPointError(f"the loss is {loss} at step {step}; lower --lr or use --precision fp32")


EVAL_BATCH_SIZE = 500  # test images per forward in data-parallel evaluation


@torch.no_grad()
def evaluate(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
    data: DataSet,
    *,
    part: int,
    parts: int,
    device: torch.device,
    fixed_batch: int = 0,
) -> tuple[float, float]:
    """(test loss, test accuracy) over the whole test set (BabyGPT's: over its scored positions), the same for any
    world size. Each of `parts` evaluators (a rank; a pipeline replica) takes its contiguous shard of the test set,
    and the sums of losses and hits are reduced over all ranks. `forward(images, labels)` returns the logits, or
    None on a rank that does not hold them (a pipeline rank without the last stage). Every evaluator makes as many
    forward calls as the longest shard needs, because sharded models and pipelines communicate inside forward: a
    shorter shard runs image 0 alone where it has no images left (not counted; TP's DTensors loop on an empty batch,
    torch 2.14.1) or, with `fixed_batch` (a pipeline's buffer size), batches padded with uncounted copies of image 0."""
    batch_size = fixed_batch or EVAL_BATCH_SIZE
    shard = shard_range(len(data.test), part, parts)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, hits, count
    for start in range(0, max(longest_shard(len(data.test), parts), 1), batch_size):
        indices = torch.arange(shard.start + start, min(shard.start + start + batch_size, shard.stop))
        n_real = len(indices)
        if fixed_batch or not n_real:
            indices = torch.cat([indices, indices.new_zeros((fixed_batch or 1) - n_real)])
        images, labels = to_device_batch(data.test, indices, data, device)
        logits = forward(images, labels)
        if logits is not None and n_real:
            # a language's positions in a row (-100: no loss, no hit); TP's split logits: on the shards, then whole
            logits, labels = logits[:n_real].float().flatten(0, -2), labels[:n_real].flatten()
            loss, predicted = F.cross_entropy(logits, labels, reduction="sum"), logits.argmax(dim=1)
            if hasattr(loss, "full_tensor"):  # (train_tp.py's loss_parallel; the argmax: each slice's best, gathered)
                loss, predicted = loss.full_tensor(), predicted.full_tensor()
            totals += torch.stack([loss.double(), (predicted == labels).sum(), (labels != -100).sum()])
    dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    loss_sum, hits, count = totals.tolist()
    return loss_sum / count, hits / count
