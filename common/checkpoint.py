"""Checkpoints with torch.distributed.checkpoint (DCP), the same format for every strategy.

Layout under `<out>/checkpoints/`:
    step_0000015/            one complete checkpoint, written after optimizer step 15
        .metadata, *.distcp  DCP: model and optimizer state, each rank writing only what it holds
        rng_rank<r>.pt       each rank's RNG state (dropout masks continue exactly after a resume)
        meta.json            step, world size, strategy, and the size and SHA-256 of every file above:
                             written last, before the rename that commits
    step_0000030.tmp/        a save in progress (or one a crash interrupted): never loaded

A checkpoint becomes visible only by the atomic rename of its `.tmp` folder, after every rank finished
writing, so a crash during a save never leaves a "latest" that cannot be loaded; a file damaged later
(truncated, corrupted) fails verification on load, and the previous checkpoint is used instead, loudly.
Keys are the model's own parameter names (`conv1.weight`, ...) through `get_state_dict`, which strips
DDP's `module.` prefix and gathers nothing for FSDP: DCP reshards at load time, so a checkpoint saved on
4 ranks loads on 2 or 1, and one strategy's checkpoint can be loaded by another. The sampler needs no
state: step s fixes the data. Loading reads tensors through DCP and RNG states with weights_only=True:
nothing is unpickled that could run code.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from common.config import Config
from common.distributed import collective_device
from common.errors import UserError
from common.runs import (
    check_resume,
    checkpoint_dir,
    complete_checkpoints,
    fingerprint,
    moved_line,
    recorded_config,
    set_aside,
)

# Optimizer state keyed by parameter name (optim.state.conv1.weight.exp_avg, optim.param_groups.conv1.weight.lr).
# The nested default keys param groups by position, so pipeline ranks, each holding different parameters,
# would write different groups under one key, and a resume would load another rank's (no betas, wrong params).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict:
    if not optimizers:  # a pipeline rank whose stages have no parameters has no optimizer
        # and, without buffers either, no state at all (get_model_state_dict refuses to return an empty one)
        return {"model": get_model_state_dict(model) if model.state_dict() else {}}
    model_sd, optim_sd = get_state_dict(model, list(optimizers), options=_OPTIONS)
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(
    cfg: Config, step: int, *, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer], steps_per_epoch: int
) -> str:
    """Write the checkpoint of step `step` to cfg.out (all ranks call this) and, with --keep, delete older ones.
    Returns its path. meta.json records the config, so that a resume can refuse settings that change the curve."""
    out_dir, keep = cfg.out, cfg.keep
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
    final = os.path.join(checkpoint_dir(out_dir), f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that crashed: incomplete by construction
    dist.barrier()
    dcp.save(_state(model, optimizers), checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    dist.barrier()  # every rank has written everything
    if rank == 0:
        meta = {
            "step": step,
            "world_size": dist.get_world_size(),
            "strategy": cfg.strategy,
            **recorded_config(cfg, steps_per_epoch),
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
        if keep:
            for _, old in complete_checkpoints(out_dir)[:-keep]:
                shutil.rmtree(old)
    dist.barrier()
    return final


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
    """torchrun restarted the group after a failure (then resuming is the only sane choice)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0


def resume_point(cfg: Config, *, log: Callable[[str], None] = print) -> str | None:
    """Every rank calls this before anything is written to cfg.out. Returns the checkpoint to resume from,
    or None for a fresh start. A resume that would change the curve raises ConfigError (on every rank); a
    fresh start moves a previous run in cfg.out aside first (rank 0, then all wait), so nothing is lost."""
    # torchrun restarts (a failure, or a machine joining) count on every rank, also on a machine whose agent
    # just (re)started: the group either resumes together or starts afresh together.
    restarted = torch.tensor([int(_restarted())], device=collective_device())
    dist.all_reduce(restarted, op=dist.ReduceOp.MAX)
    if (cfg.resume or restarted.item()) and (path := latest_checkpoint(cfg.out, log=log)):
        with open(os.path.join(path, "meta.json")) as f:
            note = check_resume(cfg, json.load(f), world_size=dist.get_world_size())
        if note:
            log(note)
        return path
    if not restarted.item() and dist.get_rank() == 0 and (moved := set_aside(cfg.out)):
        print(moved_line(cfg.out, moved), flush=True)  # rank 0's own act (a pipeline logs from its last stage)
    dist.barrier()
    return None


def load_checkpoint(path: str, *, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Load `path` into the (already wrapped or sharded) model and optimizers; returns its step."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    state = _state(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    if optimizers:
        set_state_dict(
            model, list(optimizers), model_state_dict=state["model"], optim_state_dict=state["optim"], options=_OPTIONS
        )
    elif state["model"]:
        set_model_state_dict(model, state["model"])
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
