"""The metrics contract: `<out>/metrics.jsonl`, `<out>/run.json` and the console lines.

metrics.jsonl has one JSON object per line:
    {"kind": "train", "step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s"}   every optimizer step
    {"kind": "eval", "step", "test_loss", "test_accuracy"}                    for every evaluation
`loss` is the mean over the whole global batch (reduced across ranks); evaluations cover the whole test
set; `grad_norm` is the global L2 norm of the whole model's gradient before clipping (--max-grad-norm).
run.json describes the run (strategy, world, config), its final numbers and each rank's memory.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable

import torch


def _local(t: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly sharded DTensor) tensor that this rank actually holds."""
    return t.to_local() if hasattr(t, "to_local") else t


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = _local(t)
        key = (local.untyped_storage().data_ptr(), local.storage_offset(), local.numel())
        if key not in seen:  # count a tensor shared by two names once
            seen.add(key)
            total += local.numel() * local.element_size()
    return total


def measure_memory(
    params: Iterable[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None, device: torch.device
) -> dict[str, Any]:
    """Bytes of parameters, gradients and optimizer state this rank holds, measured from its tensors."""
    params = list(params)
    state = [
        v for s in (optimizer.state.values() if optimizer else ()) for v in s.values() if isinstance(v, torch.Tensor)
    ]
    return {
        "param_bytes": _bytes(params),
        "grad_bytes": _bytes(p.grad for p in params if p.grad is not None),
        "optim_bytes": _bytes(state),
        "cuda_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
    }


class MetricsWriter:
    """Appends records to metrics.jsonl and prints progress; a no-op on every rank but the logging one."""

    def __init__(
        self,
        out_dir: str,
        *,
        enabled: bool,
        total_steps: int,
        log_every: int,
        start_step: int = 0,
        tensorboard: bool = False,
    ) -> None:
        self.enabled, self.total_steps, self.log_every = enabled, total_steps, log_every
        self.start_step = start_step
        self.started = time.perf_counter()
        self.last_train: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.samples, self.train_time = 0, 0.0
        self._file = None
        self._scalars = None  # --tensorboard: the same records as TensorBoard scalars
        if enabled and tensorboard:
            from common.tensorboard import ScalarWriter  # only with the flag: tensorboard is optional

            self._scalars = ScalarWriter(out_dir)
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            path = os.path.join(out_dir, "metrics.jsonl")
            keep = _records_up_to(path, start_step) if start_step else []
            self._file = open(path, "w")  # a resumed run keeps steps <= start_step, so no step appears twice
            for line in keep:
                self._file.write(line)
            self._file.flush()

    def _write(self, record: dict[str, Any]) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._scalars:
            self._scalars.write(record)

    def train(
        self, step: int, *, loss: float, lr: float, samples: int, step_time_s: float, grad_norm: float | None = None
    ) -> None:
        self.samples += samples
        self.train_time += step_time_s
        self.last_train = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            **({} if grad_norm is None else {"grad_norm": grad_norm}),
            "samples_per_s": samples / step_time_s,
            "step_time_s": step_time_s,
        }
        self._write(self.last_train)
        if self.enabled and (step % self.log_every == 0 or step == self.total_steps):
            done = step - self.start_step
            eta = (time.perf_counter() - self.started) / done * (self.total_steps - step)
            print(
                f"step {step:>5}/{self.total_steps} | loss {loss:.4f} | lr {lr:.2e} | "
                + ("" if grad_norm is None else f"grad norm {grad_norm:.3f} | ")
                + f"{self.samples / self.train_time:7.0f} samples/s | ETA {_clock(eta)}",
                flush=True,
            )

    def eval(self, step: int, *, test_loss: float, test_accuracy: float) -> None:
        self.last_eval = {"kind": "eval", "step": step, "test_loss": test_loss, "test_accuracy": test_accuracy}
        self._write(self.last_eval)
        if self.enabled:
            print(
                f"eval  {step:>5}/{self.total_steps} | test loss {test_loss:.4f} | "
                f"test accuracy {100 * test_accuracy:.2f}%",
                flush=True,
            )

    def final(self) -> dict[str, Any]:
        return {
            "train_loss": self.last_train.get("loss"),
            "test_loss": self.last_eval.get("test_loss"),
            "test_accuracy": self.last_eval.get("test_accuracy"),
            "samples_per_s": self.samples / self.train_time if self.train_time else None,
            "wall_time_s": time.perf_counter() - self.started,
        }

    def close(self) -> None:
        if self._scalars:
            self._scalars.close()
            self._scalars = None
        if self._file:
            self._file.close()
            self._file = None


def _records_up_to(path: str, step: int) -> list[str]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line for line in f if line.strip() and json.loads(line)["step"] <= step]


def write_run_json(out_dir: str, **fields: Any) -> None:
    """Write run.json atomically (a reader never sees half a file)."""
    path = os.path.join(out_dir, "run.json")
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f, indent=2)
    os.replace(path + ".tmp", path)


def _clock(seconds: float) -> str:
    seconds = int(max(0, seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
