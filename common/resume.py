"""Resuming a run (--resume, or torchrun restarting the group): the newest checkpoint that passes verification,
what a resume may change (a setting that decides the curve must equal the one its meta.json records, or
metrics.jsonl would silently become two runs), and metrics.jsonl cut back to where it resumes. No torch here: the
runners' preflight makes the same checks before torchrun starts, and a worker loads this module only to resume."""

from __future__ import annotations

import json
import os
from typing import Callable

from common.config import Config
from common.errors import ConfigError, UserError
from common.runs import checkpoint_dir, complete_checkpoints, fingerprint

# The settings that decide which weights step s produces: a resume with another value is refused.
TRAJECTORY = (
    *("dataset", "data_file", "train_size", "test_size", "seq_len", "seed", "batch_size"),  # which samples, in order
    *("optimizer", "lr", "weight_decay", "warmup_steps", "lr_schedule", "min_lr", "max_grad_norm"),  # the update
    *("model", "model_size", "patch_size", "heads", "kv_heads", "dropout"),  # the model
    *("experts", "top_k", "shared_expert", "capacity_factor", "aux_loss_coef"),  # its mixture of experts
    *("precision", "loss_scale", "loss_scale_growth_interval"),  # its arithmetic
)
# Settings a resume may change, said once: the layout (a DCP checkpoint loads into any), the length (a decaying
# --lr-schedule re-timed from here on), the cadences, and what is observed (--compile, --cp-attention: kernels, not
# arithmetic).
MAY_CHANGE = (
    *("strategy", "allreduce", "sharding", "shard_units", "cpu_offload", "activation_checkpointing"),
    *("schedule", "n_microbatches", "stages_per_rank", "dp", "tp", "sequence_parallel", "grad_accum_steps"),
    *("epochs", "max_steps", "log_every", "eval_every", "checkpoint_every", "keep"),
    *("compile", "profile_steps", "memory_snapshot", "tensorboard", "measure_peak", "cp_attention", "ep"),
)
# Settings that are where and how this launch runs, not what it trains: they change silently.
FREE = ("data_dir", "out", "resume", "device", "threads", "timeout_s", "preempt_signal")


class CheckpointError(UserError, RuntimeError):
    """No checkpoint that passes verification."""


def resume_point(cfg: Config, *, world_size: int, log: Callable[[str], None]) -> tuple[str, dict] | None:
    """The checkpoint this run continues from and its meta.json, or None when --out holds none; ConfigError if
    `cfg` changes a trajectory setting (the settings it does change are said in one line)."""
    if (path := latest_checkpoint(cfg.out, log=log)) is None:
        return None
    with open(os.path.join(path, "meta.json")) as f:
        meta = json.load(f)
    if note := check_resume(cfg, meta, world_size=world_size):
        log(note)
    return path, meta


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_resume(cfg: Config, meta: dict, *, world_size: int | None = None) -> str:
    """Raise ConfigError if `cfg` changes a trajectory setting recorded in checkpoint `meta`; returns the
    line about the settings it does change ("" when none changed, or the checkpoint records no config)."""
    recorded = meta.get("config") or {}
    for name in TRAJECTORY:
        if name in recorded and recorded[name] != getattr(cfg, name):
            raise ConfigError(
                f"{_flag(name)}: the run in {cfg.out} was trained with {_flag(name)} {recorded[name]}, not "
                f"{getattr(cfg, name)}; resume it with {_flag(name)} {recorded[name]}, or leave out --resume "
                f"to start a new run (a resume must not mix two runs into one curve)"
            )
    changed = [
        f"{_flag(name)} {recorded[name]} -> {getattr(cfg, name)}"
        for name in MAY_CHANGE
        if name in recorded and recorded[name] != getattr(cfg, name)
    ]
    if world_size is not None and meta.get("world_size", world_size) != world_size:
        changed.insert(0, f"{meta['world_size']} -> {world_size} processes")
    return f"resuming {cfg.out} at step {meta['step']} with {', '.join(changed)}" if changed else ""


def verify_checkpoint(path: str) -> str | None:
    """None if every file of the checkpoint has the size and SHA-256 recorded at save time, else the problem."""
    try:
        with open(os.path.join(path, "meta.json")) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"meta.json unreadable ({e})"
    for name, expected in files.items():
        if not os.path.exists(file := os.path.join(path, name)):
            return f"{name} is missing"
        actual = fingerprint(file)
        if actual["bytes"] != expected["bytes"]:
            return f"{name} has {actual['bytes']} bytes, {expected['bytes']} were written (truncated?)"
        if actual["sha256"] != expected["sha256"]:
            return f"{name} does not match its checksum (corrupted)"
    return None


def latest_checkpoint(out_dir: str, *, log: Callable[[str], None] = print) -> str | None:
    """The newest checkpoint in `out_dir` that passes verification (a damaged one is skipped, loudly), or None if
    there is none at all; CheckpointError if every one is damaged (never a silent fresh start)."""
    found = complete_checkpoints(out_dir)
    for _, path in reversed(found):
        if (problem := verify_checkpoint(path)) is None:
            return path
        log(f"WARNING: checkpoint {path} is damaged: {problem}; trying the previous one")
    if found:
        raise CheckpointError(
            f"--resume: no checkpoint in {checkpoint_dir(out_dir)} passes verification; "
            f"move the folder away to start afresh"
        )
    return None


def cut_metrics(path: str, step: int) -> None:
    """Keep the records of metrics.jsonl up to `step`, where the run resumes, and drop the later ones (a crash wrote
    them after the checkpoint it resumes from), so no step appears twice; the kept file replaces the old one in one
    rename, so a crash here loses nothing."""
    keep = []
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line)["step"] <= step]
    with open(path + ".tmp", "w") as f:
        f.writelines(keep)
    os.replace(path + ".tmp", path)
