"""Checks the runners make before torchrun starts any worker, so bad input costs one line, not a traceback.

    python -m runner.preflight STRATEGY --world-size N[,N...] [--nproc N] [--prepare-out] [training flags]

validates every flag (including the ones that depend on the world size, for each world size an elastic run
may have) and makes sure a torchvision data set is on disk, downloading it once here when it is missing and
the network allows. --nproc: refuse more CPU processes than this machine's memory holds. --resume: refuse
settings that would change the run's curve, and exit NOTHING_TO_DO when the run is already finished.
--prepare-out (one machine): move a previous run in --out aside before a new run starts. It imports torch
only when it has to download or to read a --data-file, so a normal launch pays ~0.1 s for it.
"""

from __future__ import annotations

import glob
import json
import os
import sys
import tempfile
from typing import Sequence

from common.cli import parse_config
from common.config import STRATEGIES, TEXT_DATASETS, Config
from common.data_files import DataMissingError, ensure_data
from common.errors import ConfigError
from common.resume import check_resume
from common.runs import already_done, complete_checkpoints, moved_line, set_aside, total_steps
from runner.entry import fail
from runner.layout import check_layout
from runner.memory import check_memory

# Exit status for "the run is already finished": the runner exits 0 without starting torchrun.
NOTHING_TO_DO = 3


def visible_gpus() -> int:
    """The GPUs a worker will see, known without importing torch (the workers ask torch.cuda, and check again): the
    NVIDIA device nodes, or fewer where CUDA_VISIBLE_DEVICES names fewer (CUDA stops at a negative index)."""
    nodes = len(glob.glob("/dev/nvidia[0-9]*"))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return nodes
    named = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not entry or entry.startswith("-"):
            break
        named += 1
    return min(named, nodes)


def runs_on_cpu(cfg: Config, nproc: int = 1) -> bool:
    """--device cpu, or auto where fewer GPUs are visible than processes per machine (as setup_distributed picks)."""
    return cfg.device == "cpu" or (cfg.device == "auto" and visible_gpus() < nproc)


def check_gpus(cfg: Config, nproc: int) -> None:
    """--device cuda needs a GPU for every process on this machine: NCCL cannot put two ranks on one GPU."""
    if cfg.device == "cuda" and (gpus := visible_gpus()) < nproc:
        raise ConfigError(
            f"--device cuda: {nproc} processes per machine but {gpus} GPU{'s' * (gpus != 1)} visible; "
            + (f"run NPROC={gpus}, or --device cpu" if gpus else "use --device cpu (or auto)")
        )


def latest_meta(out_dir: str) -> dict | None:
    """meta.json of the newest committed checkpoint that has a readable one, or None."""
    for _, path in reversed(complete_checkpoints(out_dir)):
        try:
            with open(os.path.join(path, "meta.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            continue  # the worker reports the damage and falls back to the previous checkpoint
    return None


def finished_line(cfg: Config, meta: dict) -> str:
    """ "already at step N of N" when the checkpoint `meta` ends the run `cfg` asks for, else ""."""
    if "steps_per_epoch" not in meta:
        return ""
    steps = total_steps(cfg, meta["steps_per_epoch"])
    return already_done(cfg.out, meta["step"], steps) if meta["step"] >= steps else ""


def check_out(out: str) -> None:
    """--out must be a folder this process can create files in, or one it can make: a read-only file system, a
    file in its place or a folder without permission is one line here, not a traceback from every worker once
    they have loaded the data. Tried by creating (and removing) a file, which also catches what permission bits
    do not say (a read-only mount, root on a folder it may not write)."""
    folder = os.path.abspath(out)
    while not os.path.exists(folder):  # the nearest folder that exists: the run makes the rest
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder):
        raise ConfigError(f"--out {out}: {folder} is a file, not a folder; choose another --out")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        problem = f"cannot write in {folder} ({e.strerror})"
        raise ConfigError(f"--out {out}: {problem}; choose a folder you can write to") from None


def check_data(cfg: Config) -> None:
    """The data is there: a torchvision data set on disk (fetched once here if missing), --data-file a readable,
    non-empty text file (common/language.py's own check, which imports torch: paid only with --data-file). The
    built-in data sets, digits and copy, are made by the workers."""
    if cfg.dataset in TEXT_DATASETS:
        if cfg.data_file:
            from common.language import read_bytes

            read_bytes(cfg.data_file)
        return
    ensure_data(cfg.dataset, cfg.data_dir)


def _take(args: list[str], flag: str, *, has_value: bool = True) -> str | None:
    """Remove `flag` (and its value) from `args`; returns the value ("" for a switch), or None if absent."""
    if flag not in args:
        return None
    i = args.index(flag)
    value = args[i + 1] if has_value else ""
    del args[i : i + 1 + has_value]
    return value


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in STRATEGIES or "--world-size" not in argv:
        fail(f"usage: python -m runner.preflight {{{','.join(STRATEGIES)}}} --world-size N[,N...] [flags]")
    strategy, rest = argv[0], argv[1:]
    world_sizes = [int(n) for n in _take(rest, "--world-size").split(",")]
    nproc = _take(rest, "--nproc")
    move_aside = _take(rest, "--prepare-out", has_value=False) is not None
    if "-h" in rest or "--help" in rest:
        return  # the training script prints the help
    try:
        for world_size in world_sizes:
            cfg = parse_config(strategy, rest, world_size=world_size)
            check_layout(cfg, world_size)
        per_machine = int(nproc or 1)
        check_gpus(cfg, per_machine)
        on_cpu = runs_on_cpu(cfg, per_machine)
        cfg.check(device_type="cpu" if on_cpu else "cuda")  # the checks that --device auto deferred
        if nproc is not None:
            check_memory(cfg, nproc=per_machine, world_size=min(world_sizes), on_cpu=on_cpu)
        check_out(cfg.out)
        # --resume: a setting that would change the run's curve is refused before anything else happens
        meta = latest_meta(cfg.out) if cfg.resume else None
        if meta:
            check_resume(cfg, meta)
        check_data(cfg)
        if meta and (finished := finished_line(cfg, meta)):
            print(finished)
            raise SystemExit(NOTHING_TO_DO)
        # a new run moves a previous one aside (train_*.py does it when run directly); but not for --resume where no
        # checkpoint has a readable meta.json: the workers verify each and refuse in one line (exit 2), never a silent
        # fresh start, which moving the run aside here would be
        unreadable = cfg.resume and not meta and complete_checkpoints(cfg.out)
        if not meta and not unreadable and move_aside and (moved := set_aside(cfg.out)):
            print(moved_line(cfg.out, moved))
    except (ConfigError, DataMissingError) as e:
        fail(str(e))
    except KeyboardInterrupt:  # Ctrl-C before any worker started (a data set downloading, say)
        print("interrupted before training started; nothing was written to --out", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
