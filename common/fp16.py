"""--precision fp16's loss scaling, loaded only with that flag (fp32 and bf16 scale nothing: `NoLossScaling` in
common/training.py, whose attributes and methods this has too)."""

from __future__ import annotations

import math

import torch

from common.config import Config


class LossScaler:
    """The loss is multiplied by `value` before backward, so that small gradients do not flush to zero in fp16, and
    clip_grad_norm divides it out again. A step whose gradients overflowed (their global norm is not finite) is
    skipped and `value` halved; after --loss-scale-growth-interval steps without, doubled: torch.amp.GradScaler's
    rule and defaults. The global norm is the same number on every rank (docs/training.md), so every rank and stage
    skips together."""

    enabled = True

    def __init__(self, cfg: Config) -> None:
        self.value, self.interval = cfg.loss_scale, cfg.loss_scale_growth_interval
        self.good_steps, self.skipped = 0, False
        self.used = self.value  # the scale the last step's loss was multiplied by (value may change after it)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.value

    def step(self, optimizer: torch.optim.Optimizer | None, grad_norm: float) -> None:
        """optimizer.step() unless the gradients overflowed; then the scale for the next step."""
        self.used, self.skipped = self.value, not math.isfinite(grad_norm)
        if optimizer and not self.skipped:
            optimizer.step()
        self.good_steps = 0 if self.skipped else self.good_steps + 1
        if self.skipped or self.good_steps == self.interval:  # (a power of two stays one: scaling is exact)
            self.value, self.good_steps = self.value * (0.5 if self.skipped else 2.0), 0

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value, self.good_steps = float(state["value"]), int(state["good_steps"])
