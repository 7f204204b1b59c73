"""--tensorboard: the metrics.jsonl records as TensorBoard scalars under <out>/tensorboard/.

Imported only with the flag (whose check, in common/config.py, makes sure the package is installed), so a run
without it never loads tensorboard. Tags are "<kind>/<field>" (train/loss, train/lr, eval/test_accuracy ...),
the x axis the optimizer step, so `tensorboard --logdir runs/` overlays every strategy's curves.
"""

from __future__ import annotations

import os
from typing import Any

from torch.utils.tensorboard import SummaryWriter


class ScalarWriter:
    def __init__(self, out_dir: str) -> None:
        self._writer = SummaryWriter(os.path.join(out_dir, "tensorboard"))

    def write(self, record: dict[str, Any]) -> None:
        for key, value in record.items():
            if key not in ("kind", "step") and isinstance(value, (int, float)) and not isinstance(value, bool):
                self._writer.add_scalar(f"{record['kind']}/{key}", value, record["step"])

    def close(self) -> None:
        self._writer.close()
