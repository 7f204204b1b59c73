"""Checks the runners make before torchrun starts any worker, so bad input costs one line, not a traceback.

    python -m common.preflight STRATEGY --world-size N[,N...] [--nproc N] [--prepare-out] [training flags]

validates every flag (including the ones that depend on the world size, for each world size an elastic run
may have) and makes sure a torchvision data set is on disk, downloading it once here when it is missing and
the network allows. --nproc: refuse more CPU processes than this machine's memory holds. --resume: refuse
settings that would change the run's curve, and exit NOTHING_TO_DO when the run is already finished.
--prepare-out (one machine): move a previous run in --out aside before a new run starts. It imports torch
only when it has to download, so a normal launch pays ~0.1 s for it.
"""

from __future__ import annotations

import sys
from typing import Sequence

from common.cli import parse_config
from common.compiling import require_compiler
from common.config import STRATEGIES, ConfigError
from common.data_files import DataMissingError, ensure_data
from common.errors import fail
from common.memory import check_memory
from common.runs import check_resume, finished_line, latest_meta, moved_line, set_aside

# Exit status for "the run is already finished": the runner exits 0 without starting torchrun.
NOTHING_TO_DO = 3


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
        fail(f"usage: python -m common.preflight {{{','.join(STRATEGIES)}}} --world-size N[,N...] [flags]")
    strategy, rest = argv[0], argv[1:]
    world_sizes = [int(n) for n in _take(rest, "--world-size").split(",")]
    nproc = _take(rest, "--nproc")
    move_aside = _take(rest, "--prepare-out", has_value=False) is not None
    if "-h" in rest or "--help" in rest:
        return  # the training script prints the help
    try:
        for world_size in world_sizes:
            cfg = parse_config(strategy, rest, world_size=world_size)
        if cfg.compile and cfg.device == "cpu":  # (with --device auto the workers check, once torch is loaded)
            require_compiler("cpu")
        if nproc is not None:
            check_memory(int(nproc), on_cpu=cfg.runs_on_cpu)
        # --resume: a setting that would change the run's curve is refused before anything else happens
        meta = latest_meta(cfg.out) if cfg.resume else None
        if meta:
            check_resume(cfg, meta)
        ensure_data(cfg.dataset, cfg.data_dir)
        if meta and (finished := finished_line(cfg, meta)):
            print(finished)
            raise SystemExit(NOTHING_TO_DO)
        if not meta and move_aside and (moved := set_aside(cfg.out)):  # (train_*.py does it when run directly)
            print(moved_line(cfg.out, moved))
    except (ConfigError, DataMissingError) as e:
        fail(str(e))


if __name__ == "__main__":
    main()
