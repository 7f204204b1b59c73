"""Checkpoints with torch.distributed.checkpoint (DCP), the same format for every strategy: docs/checkpoints.md.

`<out>/checkpoints/step_0000015/` holds DCP's files (model and optimizer state, each rank writing what it holds),
each rank's RNG state and, written last, meta.json (step, world size, config, and the size and SHA-256 of every
file). A save goes to `step_0000015.tmp/` and becomes visible only by an atomic rename once every rank has
written, so a crash never leaves a "latest" that cannot be loaded; a file damaged later fails verification, and
the previous checkpoint is used instead, loudly. Keys are the model's own parameter names (`conv1.weight`), so
DCP reshards at load time and one strategy's checkpoint loads into another. Tensors load through DCP and RNG
states with weights_only=True: nothing is unpickled that could run code.
"""

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
from common.errors import UserError, WriteError, write_error_in
from common.runs import (
    already_done,
    check_resume,
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
    from common.training import LossScaler

# Optimizer state keyed by parameter name (optim.state.conv1.weight.exp_avg, optim.param_groups.conv1.weight.lr).
# The nested default (torch 2.14.1) keys param groups by position, so pipeline ranks, each holding different parameters,
# would write different groups under one key, and a resume would load another rank's (no betas, wrong params).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict:
    if not optimizers:  # a pipeline rank whose stages have no parameters has no optimizer
        # and, without buffers either, no state at all (get_model_state_dict, torch 2.14.1, refuses an empty one)
        return {"model": get_model_state_dict(model) if model.state_dict() else {}}
    model_sd, optim_sd = get_state_dict(model, list(optimizers), options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    cfg: Config,
    step: int,
    *,
    model: nn.Module,
    optimizers: Sequence[torch.optim.Optimizer],
    scaler: LossScaler,
    steps_per_epoch: int,
) -> str:
    """Write the checkpoint of step `step` to cfg.out (all ranks call this) and, with --keep, delete older ones.
    Returns its path. meta.json records the config, so that a resume can refuse settings that change the curve,
    and fp16's loss scale (the same on every rank)."""
    rank = dist.get_rank()
    # A non-finite weight would make this checkpoint the "latest" one that every resume chokes on.
    finite = torch.tensor(
        [all(bool(torch.isfinite(p.detach()).all()) for p in model.parameters())],
        dtype=torch.int32,
        device=collective_device(),
    )
    dist.all_reduce(finite, op=dist.ReduceOp.MIN)
    if not finite.item():
        raise FloatingPointError(
            f"the weights are not finite after step {step}; no checkpoint written, the "
            f"last good one stays the latest; lower --lr or use --precision fp32"
        )
    final = os.path.join(checkpoint_dir(cfg.out), f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that crashed: incomplete by construction
    dist.barrier()
    problem = _written(lambda: _write_shards(tmp, model, optimizers), cfg.out)  # every rank: its DCP files and its RNG
    if not _anyone_failed(problem) and rank == 0:  # all of it written: rank 0 commits
        problem = _written(
            lambda: _commit(cfg, step, tmp, final, scaler=scaler, steps_per_epoch=steps_per_epoch), cfg.out
        )
    if _anyone_failed(problem):
        _give_up(problem, tmp, cfg.out)
    return final


def _write_shards(tmp: str, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
    dcp.save(_state(model, optimizers), checkpoint_id=tmp)  # raises on every rank if any rank's write failed
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{dist.get_rank()}.pt"))


def _commit(cfg: Config, step: int, tmp: str, final: str, *, scaler: LossScaler, steps_per_epoch: int) -> None:
    """Rank 0, once every rank has written: meta.json, then the rename that makes the checkpoint visible."""
    meta = {
        "step": step,
        "world_size": dist.get_world_size(),
        "strategy": cfg.strategy,
        **recorded_config(cfg, steps_per_epoch),
        **({"loss_scaler": scaler.state_dict()} if scaler.enabled else {}),
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
    if cfg.keep:
        for _, old in complete_checkpoints(cfg.out)[: -cfg.keep]:
            shutil.rmtree(old)


def _written(write: Callable[[], None], folder: str) -> str | None:
    """None if `write` wrote its files, else what stopped it: a full disk, a file-size limit, a read-only folder."""
    try:
        write()
    except (Exception, CheckpointException) as e:  # (DCP's is a BaseException)
        problem = write_error_in(e)
        if problem is None:
            raise  # not a write error: a bug, with its traceback
        with contextlib.suppress(OSError):
            problem += f"; {shutil.disk_usage(folder).free / 2**20:.0f} MiB free there"
        return problem
    return None


def _anyone_failed(problem: str | None) -> bool:
    """Whether any rank could not write its part (one all-reduce: every rank learns it together)."""
    failed = torch.tensor([problem is not None], dtype=torch.int32, device=collective_device())
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    return bool(failed.item())


def _give_up(problem: str | None, tmp: str, out_dir: str) -> None:
    """A checkpoint not written: the partial folder goes, and every rank raises WriteError (rank 0's says it)."""
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()  # the partial folder is gone before any rank reports
    raise WriteError(
        f"checkpoint {tmp} not written ({problem or 'another rank could not write its part'}), its partial files "
        f"removed; {latest_checkpoint_line(out_dir)}: make room, then continue with --resume",
        quiet=dist.get_rank() != 0,
    )


def save_model_file(state: dict, out_dir: str) -> str:
    """model.pt (rank 0): a plain state dict for inference, written whole or not at all."""
    path = os.path.join(out_dir, "model.pt")
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # never half a file
    except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError ("file write failed")
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        raise WriteError(
            f"{path} not written ({e}); {latest_checkpoint_line(out_dir)}: make room; the checkpoints hold the "
            f"trained weights too"
        ) from None
    return path


class CheckpointError(UserError, RuntimeError):
    """No checkpoint that passes verification."""


def verify_checkpoint(path: str) -> str | None:
    """None if every file of the checkpoint has the size and SHA-256 recorded at save time, else the problem."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"meta.json unreadable ({e})"
    for name, expected in files.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        actual = fingerprint(file)
        if actual["bytes"] != expected["bytes"]:
            return f"{name} has {actual['bytes']} bytes, {expected['bytes']} were written (truncated?)"
        if actual["sha256"] != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def latest_checkpoint(out_dir: str, *, log: Callable[[str], None] = print) -> str | None:
    """The newest checkpoint in `out_dir` that passes verification, or None if there is none at all.

    A damaged one is skipped for the previous one, loudly; if every checkpoint is damaged, CheckpointError
    (never a silent fresh start that would overwrite the run's history)."""
    found = complete_checkpoints(out_dir)
    for _, path in reversed(found):
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log(f"WARNING: checkpoint {path} is damaged: {problem}; trying the previous one")
    if found:
        raise CheckpointError(
            f"--resume: no checkpoint in {checkpoint_dir(out_dir)} passes verification; "
            f"move the folder away to start afresh"
        )
    return None


def _restarted() -> bool:
    """Whether torchrun restarted the group (a failure, or a machine joining), asked of every rank: also a rank
    on a machine whose agent just (re)started counts, so the group resumes, or starts afresh, together."""
    restarted = torch.tensor([int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0], device=collective_device())
    dist.all_reduce(restarted, op=dist.ReduceOp.MAX)
    return bool(restarted.item())


def checkpoint_to_resume(cfg: Config, *, log: Callable[[str], None] = print) -> str | None:
    """The checkpoint this run continues from (every rank calls this): with --resume, or after a torchrun
    restart, the latest sound one in cfg.out; None for a new run. A resume that would change the curve raises
    ConfigError on every rank."""
    if not (cfg.resume or _restarted()) or not (path := latest_checkpoint(cfg.out, log=log)):
        return None
    with open(os.path.join(path, "meta.json")) as f:
        note = check_resume(cfg, json.load(f), world_size=dist.get_world_size())
    if note:
        log(note)
    return path


def set_aside_previous_run(cfg: Config) -> None:
    """Before a new run writes to cfg.out (every rank calls this): rank 0 moves a previous run there to the first
    free cfg.out.N, so nothing of it is lost or mixed. Not after a torchrun restart, whose run is this one."""
    if not _restarted() and dist.get_rank() == 0 and (moved := set_aside(cfg.out)):
        print(moved_line(cfg.out, moved), flush=True)  # rank 0's own act (a pipeline logs from its last stage)
    dist.barrier()


def load_checkpoint(
    path: str, *, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], scaler: LossScaler
) -> int:
    """Load `path` into the (already wrapped or sharded) model, optimizers and loss scaler; returns its step."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    # fp16: a run whose every step so far overflowed saved an optimizer that never stepped, without state; it
    # must stay so here (DCP would make state with a zero step and then find none to load), as in the run itself
    keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    optimizers = optimizers if any(key.startswith("optim.state.") for key in keys) else []
    state = _state(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    if optimizers:
        set_state_dict(
            model, list(optimizers), model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS
        )
    elif state["model"]:
        set_model_state_dict(model, state["model"])
    if "loss_scaler" in meta:  # (fp16 resumes only from fp16: --precision is a trajectory setting)
        scaler.load_state_dict(meta["loss_scaler"])
    rng_file = os.path.join(path, f"rng_rank{dist.get_rank()}.pt")
    if meta["world_size"] == dist.get_world_size() and os.path.exists(rng_file):
        _set_rng_state(torch.load(rng_file, weights_only=True))
    return int(meta["step"])


def _rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


class Checkpoints:
    """A run's checkpoints and how it ends, the same in every script: `start` resumes from the latest checkpoint
    (with --resume, or after torchrun restarted the group) or sets a previous run in --out aside; `end_of_step` saves
    every --checkpoint-every steps, and when a preemption signal reached any rank saves that step and stops. Every
    rank calls both. `model` and `optimizers` are what this rank holds (a pipeline rank: its stages)."""

    def __init__(
        self,
        cfg: Config,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        scaler: LossScaler,
        *,
        sampler: GlobalBatchSampler,
        steps: int,
        log: Callable[[str], None],
    ) -> None:
        self.cfg, self.model, self.optimizers, self.scaler, self.log = cfg, model, optimizers, scaler, log
        self.steps, self.steps_per_epoch = steps, sampler.steps_per_epoch  # (a checkpoint records the epoch's length)

    def start(self, *, before_load: Callable[[], None] | None = None) -> int | None:
        """The step this run continues after: 0 for a new run, or the resumed checkpoint's; None when that already
        ends the run (one line says so, nothing is rewritten). `before_load` runs just before a checkpoint loads."""
        step = 0
        if path := checkpoint_to_resume(self.cfg, log=self.log):
            if before_load:
                before_load()
            step = load_checkpoint(path, model=self.model, optimizers=self.optimizers, scaler=self.scaler)
            self.log(f"resumed from {path} (step {step})")
        else:
            set_aside_previous_run(self.cfg)  # a new run: a previous one in --out moves to <out>.N, never overwritten
        if step >= self.steps:
            self.log(already_done(self.cfg.out, step, self.steps))
            return None
        return step

    def end_of_step(self, step: int, recorder: RunRecorder) -> bool:
        """After step `step`: its checkpoint if one is due or a preemption signal (SIGTERM, --preempt-signal) reached
        any rank; True if the run stops here (every rank saved this step: a resume repeats the run bit for bit)."""
        stop = stop_requested() if step < self.steps else None  # (after the last step the run just ends)
        if stop or (self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0):
            save_checkpoint(
                self.cfg,
                step,
                model=self.model,
                optimizers=self.optimizers,
                scaler=self.scaler,
                steps_per_epoch=self.steps_per_epoch,
            )
        if stop:
            self.log(f"stopped by {stop} after step {step} of {self.steps}, with its checkpoint: --resume continues")
            recorder.close()
        return bool(stop)
