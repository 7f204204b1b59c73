"""Run under torchrun: several trainings, one after another, in one set of processes.

    torchrun --standalone --nproc-per-node 4 tests/workers/runs.py RUNS.json

RUNS.json maps an output folder to [strategy, flags] (strategy: ddp, fsdp or pippy). Each run is the real
`train_<strategy>.train` on the real process group (each builds its own model, device mesh, shards, stages
and schedule); only the start-up of the processes -- Python, torch and the process group, which costs
more than a short run -- is shared. That is what lets the tests compare every sharding mode and every
pipeline schedule with one process within their time budget.
"""

import importlib
import json
import sys

from common.config import parse_config
from common.distributed import setup_distributed, teardown_distributed


def main() -> None:
    with open(sys.argv[1]) as f:
        runs = json.load(f)
    env = setup_distributed(timeout_s=120)
    try:
        for out, (strategy, flags) in runs.items():
            cfg = parse_config(strategy, [*flags, "--out", out], world_size=env.world_size)
            importlib.import_module(f"train_{strategy}").train(cfg, env)
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
