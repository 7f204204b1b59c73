"""What the benchmark launches: one RunSpec per run (a strategy, a process count, its flags, its launcher), in the
default plan or the smoke test's. No torch here: tests check every planned run against the scripts' flag checks."""

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

from bench.launches import torchrun
from common.config import SCHEDULES, SHARDINGS
from common.pipeline_layout import SINGLE_STAGE_SCHEDULES


@dataclass(frozen=True)
class Settings:  # what every launch of one benchmark shares
    batch_size: int  # the global batch
    warmup: int  # steps before the timed ones
    timed: int  # the steps that samples/s and the step times are taken over
    test_size: int  # the short runs' test set (evaluated after training)
    train_size: int = 0  # the data set of the short runs; 0: the scripts' default


@dataclass
class RunSpec:
    name: str  # the row's label
    strategy: str  # ddp, fsdp, pippy, baseline
    nproc: int
    args: list[str] = field(default_factory=list)  # the run's own flags
    precision: str = "fp32"
    launcher: str = "torchrun"  # python (1 process), torchrun, run_ddp.sh
    full: bool = False  # the default-length run: its test accuracy counts
    scaling: bool = False  # a run the acceptance compares: launched --repeats times, in rounds

    def flags(self, s: Settings) -> list[str]:
        """Every flag of the launch but --out."""
        own = [*self.args, *(["--precision", self.precision] if self.precision != "fp32" else [])]
        own += ["--batch-size", str(s.batch_size)]
        if self.full:
            return own
        # the default data set (train_size 0): its size changes the allocator's history, and so the step time
        own += ["--max-steps", str(s.warmup + s.timed), *(["--train-size", str(s.train_size)] if s.train_size else [])]
        return own if self.strategy == "baseline" else [*own, "--log-every", "100000", "--test-size", str(s.test_size)]

    def command(self, s: Settings, out: Path) -> list[str]:
        args = [*self.flags(s), "--out", str(out)]
        if self.launcher == "run_ddp.sh":
            return ["bash", "run_ddp.sh", *args]
        target = ["-m", "bench.baseline"] if self.strategy == "baseline" else [f"train_{self.strategy}.py"]
        python = [sys.executable] if self.nproc == 1 and self.launcher != "torchrun" else torchrun(self.nproc)
        return [*python, *target, *args]


def schedule_flags(schedule: str, *, pipeline_ranks: int) -> list[str]:
    """A pipeline schedule and what its layout needs (common/pipeline_layout.py checks it): one stage per rank
    for gpipe and 1F1B, two for the others; dualpipev at least a micro-batch per stage."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return ["--schedule", schedule]
    flags = ["--schedule", schedule, "--stages-per-rank", "2"]
    return flags + (["--n-microbatches", str(2 * pipeline_ranks)] if schedule == "dualpipev" else [])


def quick_plan() -> list[RunSpec]:
    """The smoke test's launches."""
    return [RunSpec("ddp", "ddp", 1, launcher="python"), RunSpec("baseline", "baseline", 2), RunSpec("ddp", "ddp", 2)]


def _scaling_runs(p: int, *, largest: int, bf16: bool) -> list[RunSpec]:
    """The runs at `p` processes that the acceptance compares, launched in rounds."""
    launcher = "python" if p == 1 else "torchrun"
    # at the largest count, as a user starts it (bash run_ddp.sh): its launch time is an acceptance line
    ddp_launcher = "run_ddp.sh" if p == largest and p > 1 else launcher
    runs = [RunSpec("baseline", "baseline", p, launcher=launcher), RunSpec("ddp", "ddp", p, launcher=ddp_launcher)]
    if bf16 and p == 1:  # right after its fp32 twin: the bf16 speed-up is a ratio of neighbours
        runs.append(RunSpec("ddp", "ddp", 1, precision="bf16", launcher="python"))
    runs.append(RunSpec("fsdp full", "fsdp", p, ["--sharding", "full"], launcher=launcher))
    if p > 1:  # a pipeline needs at least two ranks to be one
        runs.append(RunSpec("pipeline 1f1b", "pippy", p, schedule_flags("1f1b", pipeline_ranks=p)))
    if p >= 4 and p % 2 == 0:
        # two pipelines of p/2 stages, each on half the batch: with fewer cores than ranks, two heavy stages busy
        flags = [*schedule_flags("1f1b", pipeline_ranks=p // 2), "--dp", "2", "--n-microbatches", str(max(2, p // 2))]
        runs.append(RunSpec(f"pipeline 1f1b, 2 replicas × {p // 2} stages", "pippy", p, flags))
    return [replace(spec, scaling=True) for spec in runs]


def default_plan(
    procs: Sequence[int], *, modes_procs: int, full_runs: bool, bf16: bool, more_bf16: bool = False
) -> list[RunSpec]:
    """The benchmark's runs: the scaling runs at every count in `procs`, every other FSDP mode and pipeline
    schedule on `modes_procs` processes, and the default run in bf16."""
    n, m = max(procs), modes_procs
    plan = [spec for p in procs for spec in _scaling_runs(p, largest=n, bf16=bf16)]
    for sharding in SHARDINGS[1:]:
        if sharding != "hybrid" or m % 2 == 0:
            plan.append(RunSpec(f"fsdp {sharding}", "fsdp", m, ["--sharding", sharding]))
    plan.append(RunSpec("fsdp full, a unit per block", "fsdp", m, ["--sharding", "full", "--shard-units", "blocks"]))
    for schedule in SCHEDULES:
        if schedule != "1f1b":
            plan.append(RunSpec(f"pipeline {schedule}", "pippy", m, schedule_flags(schedule, pipeline_ranks=m)))
    if bf16:  # the default run in bf16, all of it: its test accuracy is an acceptance line
        plan.append(RunSpec("ddp", "ddp", n, precision="bf16", launcher="run_ddp.sh", full=full_runs))
    if bf16 and more_bf16:
        plan.append(RunSpec("fsdp full", "fsdp", n, ["--sharding", "full"], precision="bf16"))
        plan.append(RunSpec("pipeline 1f1b", "pippy", n, schedule_flags("1f1b", pipeline_ranks=n), precision="bf16"))
    return plan
