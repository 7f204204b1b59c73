"""Checkpoints with torch.distributed.checkpoint (DCP), the same format for every strategy.

Layout under `<out>/checkpoints/`:
    step_0000015/            one complete checkpoint, written after optimizer step 15
        .metadata, *.distcp  DCP: model and optimizer state, each rank writing only what it holds
        rng_rank<r>.pt       each rank's RNG state (dropout masks continue exactly after a resume)
        meta.json            step, world size, strategy: written last, before the rename that commits
    step_0000030.tmp/        a save in progress (or one a crash interrupted): never loaded

A checkpoint becomes visible only by the atomic rename of its `.tmp` folder, after every rank finished
writing, so a crash during a save never leaves a "latest" that cannot be loaded. Keys are the model's
own parameter names (`conv1.weight`, ...) through `get_state_dict`, which strips DDP's `module.` prefix
and gathers nothing for FSDP: DCP reshards at load time, so a checkpoint saved on 4 ranks loads on 2 or 1,
and one strategy's checkpoint can be loaded by another. The sampler needs no state: step s fixes the data.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

_COMPLETE = re.compile(r"^step_(\d{7})$")


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def complete_checkpoints(out_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every committed checkpoint, oldest first."""
    root = checkpoint_dir(out_dir)
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else ():
        match = _COMPLETE.match(name)
        if match and os.path.exists(os.path.join(root, name, "meta.json")):
            found.append((int(match.group(1)), os.path.join(root, name)))
    return sorted(found)


def _state(model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> dict:
    if not optimizers:  # a pipeline rank whose stages have no parameters has no optimizer
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, list(optimizers))
    return {"model": model_sd, "optim": optim_sd}


def save_checkpoint(out_dir: str, step: int, *, model: nn.Module,
                    optimizers: Sequence[torch.optim.Optimizer], strategy: str, keep: int = 0) -> str:
    """Write the checkpoint of step `step` (all ranks call this). Returns its path."""
    rank = dist.get_rank()
    final = os.path.join(checkpoint_dir(out_dir), f"step_{step:07d}")
    tmp = final + ".tmp"
    if rank == 0 and os.path.exists(tmp):
        shutil.rmtree(tmp)  # left by a save that crashed: incomplete by construction
    dist.barrier()
    dcp.save(_state(model, optimizers), checkpoint_id=tmp)
    torch.save(_rng_state(), os.path.join(tmp, f"rng_rank{rank}.pt"))
    dist.barrier()  # every rank has written everything
    if rank == 0:
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({"step": step, "world_size": dist.get_world_size(), "strategy": strategy}, f)
        if os.path.exists(final):  # the same step saved before a restart: keep the committed one
            shutil.rmtree(tmp)
        else:
            os.replace(tmp, final)  # the commit: atomic on POSIX file systems
        if keep:
            for _, old in complete_checkpoints(out_dir)[:-keep]:
                shutil.rmtree(old)
    dist.barrier()
    return final


def load_checkpoint(path: str, *, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> int:
    """Load `path` into the (already wrapped or sharded) model and optimizers; returns its step."""
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    state = _state(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    if optimizers:
        set_state_dict(model, list(optimizers), model_state_dict=state["model"], optim_state_dict=state["optim"])
    else:
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
