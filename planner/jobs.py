"""The ranks a set of plans measures, each measured once, in worker processes beside each other.

Each measured rank is a job: `plan_rank(cfg, world_size, rank, count)` (planner/measure.py), whose fake step is the
same wherever it runs (fake tensors, a fake process group of its own), so jobs run in `workers` processes at once
(`python -m planner --jobs`: the cores by default) and their RankMemory comes back pickled. Steps that are the same
step are measured once:

- DDP's rank runs the same step on any world of two or more ranks (the model whole, the per-rank batch, its gradient
  buckets as DDP lays them out whatever the world's size; the collectives on the fake group move nothing): its
  memory is measured once for every such world (not when counted: a count holds its collectives' group sizes).
- A pipeline's TP ranks of one stage split its layers into slices (planner/plan.py's `ranks_to_measure` lists them
  all): the first and the last TP rank of each stage are measured and, where the two hold the same (chunks are never
  larger further on: any rank between them holds no more than the first and no less than the last), the ranks
  between them are that, with their own rank; else they are measured too. Not when counted either: each rank's
  count names its own groups.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Callable

from common.config import Config
from planner.measure import RankMemory, plan_rank


@dataclass(frozen=True)
class Job:
    """Rank `rank` of `world_size` training `cfg`, its step counted with `count`."""

    cfg: Config
    world_size: int
    rank: int
    count: bool
    depth: int = 0  # a deep BabyGPT or ViT planned at fewer blocks (planner/plan.py: shallow_depths); 0: its own

    @cached_property
    def key(self) -> str:
        """The same for two jobs that measure the same step (the module's docstring says which)."""
        cfg = self.cfg
        if cfg.strategy == "ddp" and not self.count and self.world_size > 1:
            chunk = cfg.chunk_size(self.world_size)  # (what the rank's step reads of the batch and the world)
            alike = replace(cfg, batch_size=chunk, train_size=chunk)
            return repr(("ddp on a world of more than one", alike, self.depth))
        return repr((cfg, self.world_size, self.rank, self.count, self.depth))


def _measure(job: Job) -> RankMemory:
    if not job.depth:
        return plan_rank(job.cfg, job.world_size, job.rank, count=job.count)
    from planner.plan import model_depth

    with model_depth(job.cfg.model_size, job.depth, job.cfg.model):
        return plan_rank(job.cfg, job.world_size, job.rank, count=job.count)


def _measure_in_worker(job: Job) -> RankMemory:
    """_measure in a worker process, its RankMemory pickled back: without the operators' calls, kept to replay them
    (Op.call: bench/machine.py, which counts its steps in its own process), which do not pickle."""
    memory = _measure(job)
    if memory.count is not None:
        memory.count.ops = {key: replace(op, call=None) for key, op in memory.count.ops.items()}
    return memory


def default_workers() -> int:
    """The cores this process may run on, up to 8 (a worker planning a 22 B ViT holds ~0.8 GB)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cores, 8)


def measure(
    jobs: list[Job], *, workers: int = 1, started: Callable[[Job], None] | None = None
) -> dict[str, RankMemory]:
    """{job.key: its RankMemory} for `jobs`, each step once, in their order; `started(job)` as each starts (in this
    process with one worker, else in `workers` processes, as many jobs at a time)."""
    steps: dict[str, Job] = {}
    for job in jobs:  # each step once, where it is first asked for
        steps.setdefault(job.key, job)
    todo = list(steps.values())
    found: dict[str, RankMemory] = {}
    if workers <= 1 or len(todo) <= 1:
        for job in todo:
            if started:
                started(job)
            found[job.key] = _measure(job)
        return found
    import multiprocessing

    # (spawned: a fresh interpreter, not a fork of this one's torch)
    with ProcessPoolExecutor(min(workers, len(todo)), mp_context=multiprocessing.get_context("spawn")) as pool:
        running: dict[Future, Job] = {}
        waiting = iter(todo)
        while True:
            while len(running) < min(workers, len(todo)):  # (as many at a time as workers: `started` is when)
                job = next(waiting, None)
                if job is None:
                    break
                if started:
                    started(job)
                running[pool.submit(_measure_in_worker, job)] = job
            if not running:
                return found
            done, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in done:
                found[running.pop(future).key] = future.result()


def same_but_rank(a: RankMemory, b: RankMemory) -> bool:
    """Whether two ranks hold the same: every figure but their rank (uncounted)."""
    return all(getattr(a, f.name) == getattr(b, f.name) for f in fields(a) if f.name != "rank")


def tp_slices(cfg: Config, world_size: int, ranks: list[int], count: bool) -> dict[int, tuple[int, int]]:
    """{rank: (the first, the last TP rank of its stage)} for the ranks between them that need not be measured: a
    pipeline's TP ranks of one stage (--tp; the mesh is (dp, pp, tp), TP innermost), uncounted."""
    if cfg.strategy != "pippy" or cfg.tp <= 2 or count:
        return {}
    return {r: (r - r % cfg.tp, r - r % cfg.tp + cfg.tp - 1) for r in ranks if 0 < r % cfg.tp < cfg.tp - 1}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
