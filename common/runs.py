"""Run folders: their checkpoints, the run's length, and never losing a previous run (what a resume may change:
common/resume.py). No torch here: the runners' preflight makes the same checks before torchrun starts."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re

from common.config import Config

_COMPLETE = re.compile(r"^step_(\d{7})$")
# What makes a folder a run's: set aside whole when a new run (no --resume) is started in it.
RUN_FILES = ("metrics.jsonl", "run.json", "checkpoints", "model.pt")


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


def latest_checkpoint_line(out_dir: str) -> str:
    """Where a run that stops now would go on from, in words: for the one-line reports of an interrupted run."""
    found = complete_checkpoints(out_dir)
    if not found:
        return "no checkpoint was written (--checkpoint-every N writes one every N steps)"
    return f"the latest checkpoint is {found[-1][1]} (step {found[-1][0]})"


def fingerprint(file: str) -> dict[str, object]:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return {"bytes": os.path.getsize(file), "sha256": digest.hexdigest()}


def recorded_config(cfg: Config, steps_per_epoch: int) -> dict:
    """What a checkpoint records about the run (meta.json "config" and "steps_per_epoch")."""
    return {"config": dataclasses.asdict(cfg), "steps_per_epoch": steps_per_epoch}


def total_steps(cfg: Config, steps_per_epoch: int) -> int:
    """The run's length in optimizer steps: --epochs, cut at --max-steps."""
    steps = cfg.epochs * steps_per_epoch
    return min(steps, cfg.max_steps) if cfg.max_steps else steps


def already_done(out_dir: str, step: int, steps: int) -> str:
    return f"{out_dir}: already at step {step} of {steps}; nothing to train (raise --max-steps or --epochs)"


def set_aside(out_dir: str) -> str | None:
    """Move a previous run in `out_dir` to the first free `out_dir.N` (N = 1, 2, ...); returns where, or None
    when there was none. The new run then starts in an empty folder: nothing of the old one is lost or mixed."""
    if not any(os.path.exists(os.path.join(out_dir, name)) for name in RUN_FILES):
        return None
    n = 1
    while os.path.exists(f"{out_dir.rstrip(os.sep)}.{n}"):
        n += 1
    moved = f"{out_dir.rstrip(os.sep)}.{n}"
    os.rename(out_dir, moved)
    return moved


def moved_line(out_dir: str, moved: str) -> str:
    return f"{out_dir} held a previous run: moved it to {moved} (pass --resume to continue a run instead)"
