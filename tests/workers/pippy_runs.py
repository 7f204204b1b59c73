"""Run under torchrun: several pipeline trainings, one after another, in one set of processes.

    torchrun --standalone --nproc-per-node 4 tests/workers/pippy_runs.py RUNS.json

RUNS.json maps an output folder to the flags of train_pippy.py. Each run is the real `train_pippy.train`
on the real process group (each builds its own device mesh, stages and schedule); only the start-up of
four Python processes with torch, which costs more than a short run, is shared. That is what lets the
tests cover every schedule at two micro-batch counts within their time budget.
"""

import json
import sys

import train_pippy
from common.config import parse_config
from common.distributed import setup_distributed, teardown_distributed


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    env = setup_distributed(timeout_s=120)
    try:
        for out, flags in runs.items():
            cfg = parse_config("pippy", [*flags, "--out", out], world_size=env.world_size)
            train_pippy.train(cfg, env)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
