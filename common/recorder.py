"""Everything a run reports, in one object: `<out>/metrics.jsonl` and the console's progress lines, TensorBoard
(--tensorboard), the profiler (--profile-steps), each rank's memory, `<out>/run.json` and the final line. The
records and their meaning: the README, "What a run writes"."""

from __future__ import annotations

import contextlib
import json
import os
import time
from datetime import timedelta
from typing import Any, ContextManager, Iterable, Iterator

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import DistEnv, Progress, local_part
from common.errors import WriteError
from common.runs import latest_checkpoint_line
from common.training import NoLossScaling, check_finite

_OFF = contextlib.nullcontext()  # reusable: entering it does nothing


class RunRecorder:
    """Created once the run's first step is known; `steps()` yields the steps to train, `train()` records each
    one, `eval()` each evaluation, `finish()` ends the run. Only the rank that holds the loss (`logs`: rank 0,
    or the pipeline's last stage) writes and prints; every rank must call `train` and `finish`."""

    def __init__(
        self, cfg: Config, env: DistEnv, *, start_step: int, total_steps: int, parameters: int, logs: bool
    ) -> None:
        self.cfg, self.env, self.logs, self.parameters = cfg, env, logs, parameters
        self.start_step, self.total_steps = start_step, total_steps
        self.started = self.step_started = time.perf_counter()
        self.last_train: dict[str, Any] = {}
        self.last_eval: dict[str, Any] = {}
        self.samples, self.train_time = 0, 0.0
        self.skipped_steps: list[int] = []  # fp16: this launch's steps whose gradients overflowed, on this rank
        self._file = self._scalars = None
        if logs:
            with writing(os.path.join(cfg.out, "metrics.jsonl"), cfg.out):
                self._file = _open_metrics(cfg.out, keep_up_to=start_step)
            if cfg.tensorboard:
                from common.tensorboard import ScalarWriter  # only with the flag: tensorboard is optional

                self._scalars = ScalarWriter(cfg.out)
        self.params: list[torch.nn.Parameter] = []
        self.optimizer: torch.optim.Optimizer | None = None
        self.parts: dict[str, list[torch.nn.Parameter]] = {}
        self.peak: Any = None
        if cfg.measure_peak and env.device.type == "cpu" and not cfg.compile:  # (a dispatch mode would recompile)
            from common.memory_peak import PeakOfStep  # only with the flag

            self.peak = PeakOfStep(start_step + 2, self)  # the launch's second step: the first sets things up
        self.throughput = None
        if cfg.model == "gpt":  # a language model's tokens/s and, on a GPU, MFU: only then loaded
            from common.throughput import Throughput

            self.throughput = Throughput(cfg, env.device, world_size=env.world_size)
        self.profiler = None
        if cfg.profile_steps:
            from common.profiling import StepProfiler  # only with the flag

            self.profiler = StepProfiler(
                cfg.profile_steps, out_dir=cfg.out, rank=env.rank, device=env.device, memory=cfg.memory_snapshot
            )

    def track_memory(self, params: Iterable, optimizer: torch.optim.Optimizer | None, *, parts: dict | None = None):
        """What this rank keeps between steps (its parameters, their gradients, the optimizer's state): run.json
        gets its bytes, and with --measure-peak the peak of a step above it; `parts` ({name: some of `params`}),
        the bytes of those parameters too (TP: what it splits)."""
        self.params, self.optimizer, self.parts = list(params), optimizer, parts or {}

    def span(self, name: str) -> ContextManager:
        """A named part of a step in the profiler's trace while --profile-steps profiles it; a no-op otherwise."""
        return _OFF if self.profiler is None else self.profiler.span(name)

    def steps(self) -> Iterator[int]:
        """The steps left to train, start_step + 1 .. total_steps; each one's clock (and profiler window) starts
        as it is yielded."""
        for step in range(self.start_step + 1, self.total_steps + 1):
            self.step_started = time.perf_counter()
            Progress.step = step  # (for the one-line report of an out-of-memory error)
            if self.profiler:
                self.profiler.step_start(step)
            if self.peak:
                self.peak.starts(step)
            yield step

    def train(
        self, step: int, *, loss: float, lr: float, grad_norm: float, scaler: NoLossScaling, **extra: object
    ) -> None:
        """Record optimizer step `step`, whose time ends here. A non-finite loss raises FloatingPointError (the
        loss is reduced over all ranks, so every rank stops together); fp16's records add the loss scale and
        whether the step was skipped (its gradients overflowed: grad_norm null); `extra` joins the record
        (train_ep.py's routing)."""
        step_time_s = time.perf_counter() - self.step_started
        check_finite(loss, step)
        fp16 = {"loss_scale": scaler.used, "skipped": scaler.skipped} if scaler.enabled else {}
        if scaler.skipped:
            self.skipped_steps.append(step)
        samples = self.cfg.batch_size
        self.samples += samples
        self.train_time += step_time_s
        self.last_train = {
            "kind": "train",
            "step": step,
            "loss": loss,
            "lr": lr,
            "grad_norm": None if scaler.skipped else grad_norm,
            "samples_per_s": samples / step_time_s,
            **(self.throughput.rates(samples / step_time_s) if self.throughput else {}),  # tokens/s, MFU
            "step_time_s": step_time_s,
            **fp16,
            **extra,
        }
        with self.span("metrics"):  # the profiled step includes what recording it costs
            self._write(self.last_train)
            if self.logs and (step % self.cfg.log_every == 0 or step == self.total_steps):
                eta = (time.perf_counter() - self.started) / (step - self.start_step) * (self.total_steps - step)
                print(
                    f"step {step:>5}/{self.total_steps} | loss {loss:.4f} | lr {lr:.2e} | grad norm {grad_norm:.3f} | "
                    f"{self.samples / self.train_time:7.0f} samples/s | ETA {timedelta(seconds=int(max(0, eta)))}",
                    flush=True,
                )
            if self.logs and scaler.skipped:
                print(
                    f"step {step:>5}: fp16 gradients overflowed at loss scale {scaler.used:g}: step skipped, "
                    f"scale now {scaler.value:g}",
                    flush=True,
                )
        if self.profiler:
            self.profiler.step_end(step)
        if self.peak:
            self.peak.ends(step)

    def eval_due(self, step: int) -> bool:
        """Whether --eval-every asks for an evaluation after step `step` (the final one comes after the loop)."""
        return bool(self.cfg.eval_every) and step % self.cfg.eval_every == 0 and step != self.total_steps

    def eval(self, step: int, test_loss: float, test_accuracy: float) -> None:
        self.last_eval = {"kind": "eval", "step": step, "test_loss": test_loss, "test_accuracy": test_accuracy}
        self._write(self.last_eval)
        if self.logs:
            print(
                f"eval  {step:>5}/{self.total_steps} | test loss {test_loss:.4f} | "
                f"test accuracy {100 * test_accuracy:.2f}%",
                flush=True,
            )

    def finish(self, *, files: Iterable[str] = (), **sections: Any) -> None:
        """End the run (every rank calls this: it gathers). run.json gets each rank's memory (what track_memory
        was given; the peak with --measure-peak), the profile, and the strategy's own `sections` (mesh=...,
        pipeline=...); the final line names `files`, the others the run wrote."""
        mine = {"rank": self.env.rank, **measure_memory(self.params, self.optimizer, self.env.device)}
        if self.parts:
            mine["param_bytes_of"] = {name: _bytes(part) for name, part in self.parts.items()}
        per_rank: list[Any] = [None] * dist.get_world_size()
        mine["skipped_steps"] = self.skipped_steps  # fp16: this rank's own decisions (the same on every rank)
        peak = {"peak_bytes": self.peak.bytes, "allocator_peak_bytes": self.peak.allocator_bytes} if self.peak else {}
        dist.all_gather_object(per_rank, {**mine, **peak})
        skipped = [r.pop("skipped_steps") for r in per_rank]
        if self.cfg.precision == "fp16":
            sections["loss_scaling"] = {"skipped_steps_per_rank": skipped}
        memory: dict[str, Any] = {"per_rank": per_rank, **({"peak": self.peak.describe()} if self.peak else {})}
        profile = self.profiler.report() if self.profiler else None
        if self.logs:
            final = {
                "train_loss": self.last_train.get("loss"),
                "test_loss": self.last_eval.get("test_loss"),
                "test_accuracy": self.last_eval.get("test_accuracy"),
                "samples_per_s": self.samples / self.train_time if self.train_time else None,
                "wall_time_s": time.perf_counter() - self.started,
            }
            final = self.throughput.report(final, sections) if self.throughput else final  # + tokens/s, MFU
            env, cfg = self.env, self.cfg
            run = {
                "strategy": cfg.strategy,
                "world_size": env.world_size,
                "backend": env.backend,
                "device": env.device.type,
                "torch_version": torch.__version__,
                "threads_per_process": torch.get_num_threads() if env.device.type == "cpu" else None,
                "config": cfg.flags(),
                "model": {"size": cfg.model_size, "parameters": self.parameters},
                **sections,
            }
            write_run_json(cfg.out, **run, profile=profile, final=final, memory=memory)
            written = ", ".join(os.path.join(self.cfg.out, f) for f in ("metrics.jsonl", "run.json", *files))
            said = self.throughput.said(final) if self.throughput else ""  # a language's "12345 tokens/s | "
            print(
                f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
                f"{said}{final['wall_time_s']:.1f} s | {written}",
                flush=True,
            )
        self.close()

    def close(self) -> None:
        for part in (self._scalars, self._file):
            if part:
                part.close()
        self._scalars = self._file = None

    def _write(self, record: dict[str, Any]) -> None:
        if self._file:
            complete = os.fstat(self._file.fileno()).st_size  # every record so far, flushed whole
            try:
                with writing(self._file.name, self.cfg.out):
                    self._file.write(json.dumps(record) + "\n")
                    self._file.flush()
            except WriteError:
                with contextlib.suppress(OSError):
                    os.truncate(self._file.name, complete)  # no half record for a resume to trip on
                # kept, never closed: its buffer holds the record that did not fit, and closing would write it
                self._abandoned, self._file = self._file, None
                raise
        if self._scalars:
            self._scalars.write(record)


@contextlib.contextmanager
def writing(path: str, out_dir: str) -> Iterator[None]:
    """A full disk (or a file-size limit, a folder gone read-only) while writing `path`: WriteError, one line."""
    try:
        yield
    except OSError as e:
        raise WriteError(
            f"{path} not written ({e.strerror or e}); {latest_checkpoint_line(out_dir)}: make room, then "
            f"continue with --resume"
        ) from None


def _open_metrics(out_dir: str, *, keep_up_to: int):
    """metrics.jsonl, to append to: a new one, or a resumed run's, cut back to the step it resumes after."""
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "metrics.jsonl")
    if not keep_up_to:
        return open(path, "w")  # a new run (a previous one in --out was moved aside), or a restart from step 0
    from common.resume import cut_metrics  # (only a resumed run)

    cut_metrics(path, keep_up_to)
    return open(path, "a")


def _bytes(tensors: Iterable[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        local = local_part(t)
        # the storage itself, not its address: the planner's fake tensors all have address 0
        key = (local.untyped_storage()._cdata, local.storage_offset(), local.numel())
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


def write_run_json(out_dir: str, **fields: Any) -> None:
    """Write run.json atomically (a reader never sees half a file)."""
    path = os.path.join(out_dir, "run.json")
    with writing(path, out_dir):
        with open(path + ".tmp", "w") as f:
            json.dump(fields, f, indent=2)
        os.replace(path + ".tmp", path)
