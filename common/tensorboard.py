"""--tensorboard: the metrics.jsonl records as TensorBoard scalars under <out>/tensorboard/.

Imported only with the flag, so a run without it never loads tensorboard (or needs it installed).
Tags are "<kind>/<field>" (train/loss, train/lr, eval/test_accuracy ...), the x axis the optimizer step,
so `tensorboard --logdir runs/` overlays every strategy's curves.
"""

from __future__ import annotations

import os
from typing import Any

from common.errors import UserError


class TensorBoardMissing(UserError, ImportError):
    """--tensorboard without the tensorboard package."""


class ScalarWriter:
    def __init__(self, out_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise TensorBoardMissing(
                "--tensorboard: the tensorboard package is not installed; pip install tensorboard"
            ) from None
        self._writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        self._writer.close()
