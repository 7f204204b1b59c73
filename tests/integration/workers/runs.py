"""Several trainings, one after another, in one set of processes.

    torchrun --standalone --nproc-per-node 4 tests/integration/workers/runs.py RUNS.json
    python tests/integration/workers/runs.py RUNS.json                     # one process, as `python train_ddp.py` runs

RUNS.json maps an output folder to {"strategy", "flags", "rewind", "observe"} (strategy: ddp, fsdp, pippy or tp;
rewind: null, or [a run folder, a step] to start from a copy of that folder as it stood after that step; observe:
probes that see what a feature did, tests/integration/workers/observe.py). What each run prints, on every rank,
also goes to `<out>.log`, so that a test reads its own run's lines (a resume's, say). Each run
is the real `train_<strategy>.train` on the real process group (each builds its own model, device mesh,
shards, stages and schedule); only the start-up of the processes -- Python, torch and the process group,
which costs more than a short run -- and the built-in data set are shared. That is what lets the tests
compare every sharding mode and every pipeline schedule with one process within their time budget.
"""

import contextlib
import functools
import importlib
import json
import sys
from pathlib import Path
from typing import TextIO

import torch
import torch.distributed as dist

import common.digits
from common.cli import parse_config
from common.distributed import run, setup_distributed, teardown_distributed
from tests.helpers import rewind
from tests.integration.workers.observe import Observer
from tests.integration.workers.ring_check import check_ring
from tests.integration.workers.skip_agreement import check_skip_agreement

CHECKS = {"skip-agreement": check_skip_agreement, "ring": check_ring}  # not trainings: checks on real ranks

# The built-in data set is a pure function of its arguments, and no run writes into it (to_device_batch
# gathers copies): built once per process instead of once per run, it saves ~0.15 s of every run on every rank.
common.digits.make_digits = functools.cache(common.digits.make_digits)


class Tee:
    """stdout that also writes into a run's own log (every rank appends whole lines: print flushes each)."""

    def __init__(self, *streams: TextIO) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    env = setup_distributed(timeout_s=120)
    default_threads = torch.get_num_threads()
    try:
        for out, run in runs.items():
            if run["rewind"]:
                if env.rank == 0:
                    rewind(Path(run["rewind"][0]), Path(out), run["rewind"][1])
                if dist.is_initialized():
                    dist.barrier()  # every rank sees the copy before its run reads it
            if run["strategy"] in CHECKS:
                CHECKS[run["strategy"]](env, Path(out))
                continue
            cfg = parse_config(run["strategy"], [*run["flags"], "--out", out], world_size=env.world_size)
            torch.set_num_threads(cfg.threads or default_threads)  # what setup_distributed does with --threads
            observer = Observer(hooks=run["observe"])
            Path(out).parent.mkdir(parents=True, exist_ok=True)
            with open(f"{out}.log", "a", buffering=1) as log, contextlib.redirect_stdout(Tee(sys.stdout, log)):
                importlib.import_module(f"train_{run['strategy']}").train(cfg, env)
            observer.close(out, env.rank)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    run(main)  # (a finished process ends without the interpreter's shutdown, as the scripts do)
