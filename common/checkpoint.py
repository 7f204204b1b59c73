"""Checkpoints with torch.distributed.checkpoint (DCP), the same format for every strategy (docs/checkpoints.md):
`<out>/checkpoints/step_0000015/` holds DCP's files, each rank's RNG state and, written last, meta.json (step, world
size, config, each file's size and SHA-256). A save becomes visible by an atomic rename once every rank has written;
keys are the model's own parameter names, so DCP reshards at load time and strategies read each other's."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from typing import TYPE_CHECKING, Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from common.config import Config
from common.distributed import collective_device, stop_requested
from common.errors import WriteError, write_error_in
from common.runs import (
    already_done,
    checkpoint_dir,
    complete_checkpoints,
    fingerprint,
    latest_checkpoint_line,
    moved_line,
    recorded_config,
    set_aside,
)

if TYPE_CHECKING:
    from common.data import GlobalBatchSampler
    from common.recorder import RunRecorder
    from common.training import NoLossScaling

# Optimizer state keyed by parameter name: the nested default (torch 2.14.1) keys param groups by position, and
# pipeline ranks, each holding other parameters, would write different groups under one key.
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Checkpoints:
    """A run's checkpoints and how it ends, the same in every script: `start` resumes from the latest sound
    checkpoint (with --resume, or after torchrun restarted the group) or sets a previous run in --out aside;
    `end_of_step` saves every --checkpoint-every steps, and when a preemption signal reached any rank saves that step
    and stops. Every rank calls both, with what it holds (a pipeline rank: its stages)."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: NoLossScaling,
        *,
        sampler: GlobalBatchSampler,
        steps: int,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.model, self.optimizers, self.scaler, self.log = cfg, model, optimizers, scaler, log
        self.steps, self.steps_per_epoch = steps, sampler.steps_per_epoch  # (meta.json records the epoch's length)

    def start(self, *, before_load: Callable[[], None] | None = None) -> int | None:
        """The step this run continues after (0: a new run), or None when that ends the run (said in one line,
        nothing rewritten). `before_load` runs just before a checkpoint loads."""
        step, restarted, found = 0, _restarted(), None
        if self.cfg.resume or restarted:  # only then: which checkpoint, and what a resume may change
            from common.resume import resume_point

            found = resume_point(self.cfg, world_size=dist.get_world_size(), log=self.log)  # ConfigError: a new curve
        if found:
            if before_load:
                before_load()
            step = self._load(*found)
            self.log(f"resumed from {found[0]} (step {step})")
        else:  # a new run: rank 0 moves a previous one to <out>.N first (not after a restart: this run is that one)
            if not restarted and dist.get_rank() == 0 and (moved := set_aside(self.cfg.out)):
                print(moved_line(self.cfg.out, moved), flush=True)  # rank 0's own act (a pipeline logs elsewhere)
            dist.barrier()
        if step >= self.steps:
            self.log(already_done(self.cfg.out, step, self.steps))
            return None
        return step

    def end_of_step(self, step: int, recorder: RunRecorder) -> bool:
        """After step `step`: its checkpoint if one is due or a preemption signal (SIGTERM, --preempt-signal) reached
        any rank; True if the run stops here (every rank saved this step: a resume repeats the run bit for bit)."""
        stop = stop_requested() if step < self.steps else None  # (after the last step the run just ends)
        if stop or (self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0):
            self.save(step)
        if stop:
            self.log(f"stopped by {stop} after step {step} of {self.steps}, with its checkpoint: --resume continues")
            recorder.close()
        return bool(stop)

    def save(self, step: int) -> str:
        """Write step `step`'s checkpoint (every rank) and, with --keep, delete older ones; returns its path."""
        finite = all(bool(torch.isfinite(p.detach()).all()) for p in self.model.parameters())
        if not _everyone(finite):  # a non-finite weight would make the latest checkpoint one no resume can use
            raise FloatingPointError(
                f"the weights are not finite after step {step}; no checkpoint written, the "
                f"last good one stays the latest; lower --lr or use --precision fp32"
            )
        final = os.path.join(checkpoint_dir(self.cfg.out), f"step_{step:07d}")
        tmp = final + ".tmp"
        if dist.get_rank() == 0 and os.path.exists(tmp):
            shutil.rmtree(tmp)  # left by a save that crashed: incomplete by construction
        dist.barrier()
        problem = _written(lambda: self._write_shards(tmp), self.cfg.out)  # every rank: its DCP files and its RNG
        if _everyone(problem is None) and dist.get_rank() == 0:  # all of it written: rank 0 commits
            problem = _written(lambda: self._commit(step, tmp, final), self.cfg.out)
        if not _everyone(problem is None):  # the partial folder goes; every rank raises (rank 0's line says it)
            if dist.get_rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            dist.barrier()
            raise WriteError(
                f"checkpoint {tmp} not written ({problem or 'another rank could not write its part'}), its partial "
                f"files removed; {latest_checkpoint_line(self.cfg.out)}: make room, then continue with --resume",
                quiet=dist.get_rank() != 0,
            )
        return final

    def _write_shards(self, tmp: str) -> None:
        dcp.save(_state(self.model, self.optimizers), checkpoint_id=tmp)  # raises on every rank if any rank's failed
        state = {"cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state()
        torch.save(state, os.path.join(tmp, f"rng_rank{dist.get_rank()}.pt"))

    def _commit(self, step: int, tmp: str, final: str) -> None:
        """Rank 0, once every rank has written: meta.json (fp16 adds the loss scale), then the rename."""
        meta = {
            "step": step,
            "world_size": dist.get_world_size(),
            "strategy": self.cfg.strategy,
            **recorded_config(self.cfg, self.steps_per_epoch),
            **({"loss_scaler": self.scaler.state_dict()} if self.scaler.enabled else {}),
            "files": {name: fingerprint(os.path.join(tmp, name)) for name in sorted(os.listdir(tmp))},
        }
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(final):  # the same step saved before a restart: keep the committed one
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)  # the commit: atomic on POSIX file systems
        if self.cfg.keep:
            for _, old in complete_checkpoints(self.cfg.out)[: -self.cfg.keep]:
                shutil.rmtree(old)

    def _load(self, path: str, meta: dict) -> int:
        """Load `path` into the (already wrapped or sharded) model, optimizers and loss scaler; returns its step."""
        # fp16: a run whose every step so far overflowed saved an optimizer that never stepped, without state; it
        # must stay so (DCP would make state with a zero step and then find none to load), as in the run itself
        keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        optimizers = self.optimizers if any(key.startswith("optim.state.") for key in keys) else []
        state = _state(self.model, optimizers)
        dcp.load(state, checkpoint_id=path)
        if optimizers:
            set_state_dict(
                self.model,
                list(optimizers),
                model_state_dict=state["model"],
                optim_state_dict=state["optim"],
                options=_OPTIONS,
            )
        elif state["model"]:
            set_model_state_dict(self.model, state["model"])
        if "loss_scaler" in meta:  # (fp16 resumes only from fp16: --precision is a trajectory setting)
            self.scaler.load_state_dict(meta["loss_scaler"])
        rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
        if meta["world_size"] == dist.get_world_size() and os.path.exists(rng_file):
            rng = torch.load(rng_file, weights_only=True)  # (weights_only: nothing unpickled could run code)
            torch.set_rng_state(rng["cpu"])
            if "cuda" in rng and torch.cuda.is_available():
                torch.cuda.set_rng_state(rng["cuda"])
        return int(meta["step"])


def _state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict:
    if not optimizers:  # a pipeline rank whose stages have no parameters has no optimizer
        # and, without buffers either, no state at all (get_model_state_dict, torch 2.14.1, refuses an empty one)
        return {"model": get_model_state_dict(model) if model.state_dict() else {}}
    model_sd, optim_sd = get_state_dict(model, list(optimizers), options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def _everyone(ok: bool) -> bool:
    """Whether `ok` holds on every rank (one all-reduce: every rank learns it together)."""
    flag = torch.tensor([int(ok)], dtype=torch.int32, device=collective_device())
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _restarted() -> bool:
    """Whether torchrun restarted the group (a failure, or a machine joining), asked of every rank: a rank on a
    machine whose agent just (re)started counts too, so the group resumes, or starts afresh, together."""
    return not _everyone(int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0)


def _written(write: Callable[[], None], folder: str) -> str | None:
    """None if `write` wrote its files, else what stopped it: a full disk, a file-size limit, a read-only folder."""
    try:
        write()
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        if (problem := write_error_in(e)) is None:
            raise  # not a write error: a bug, with its traceback
        with contextlib.suppress(OSError):
            problem += f"; {shutil.disk_usage(folder).free / 1e6:.0f} MB free there"
        return problem
    return None
