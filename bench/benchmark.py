"""Benchmark: every strategy against a conventional baseline and against the machine's matmul peak.

    python -m bench                      # the default suite (~10 min on 2 cores): runs/bench/bench.{json,md}
    python -m bench --wait-quiet 600     # first wait (up to 600 s) until the 1-min load average is < 1
    python -m bench --only ddp,baseline --procs 1,2 --timed-steps 10
    python -m bench --quick              # seconds: tiny settings, for the smoke test

docs/performance.md says what each phase measures and what each number in bench.json and bench.md is.
"""

import argparse
import json
import re
import sys
import timeit
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.launches import CORES, LoadWatch, Parser, launch_and_read, numbers, torchrun
from bench.report import annotate, markdown, scaling_table
from common.config import SCHEDULES, SHARDINGS
from common.pipeline_layout import SINGLE_STAGE_SCHEDULES

MODES_PROCS = 2  # processes of the FSDP modes and pipeline schedules beyond the scaling runs
TEST_SIZE, TIMEOUT_S = 256, 300  # the short runs' test set (evaluated once, after timing); seconds per launch


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


def _scaling_runs(p: int, *, largest: int) -> list[RunSpec]:
    """The runs at `p` processes that the acceptance compares, launched in rounds."""
    launcher = "python" if p == 1 else "torchrun"
    # at the largest count, as a user starts it (bash run_ddp.sh): its launch time is an acceptance line
    ddp_launcher = "run_ddp.sh" if p == largest and p > 1 else launcher
    runs = [RunSpec("baseline", "baseline", p, launcher=launcher), RunSpec("ddp", "ddp", p, launcher=ddp_launcher)]
    if p == 1:  # right after its fp32 twin: the bf16 speed-up is a ratio of neighbours
        runs.append(RunSpec("ddp", "ddp", 1, precision="bf16", launcher="python"))
    runs.append(RunSpec("fsdp full", "fsdp", p, ["--sharding", "full"], launcher=launcher))
    if p > 1:  # a pipeline needs at least two ranks to be one
        runs.append(RunSpec("pipeline 1f1b", "pippy", p, schedule_flags("1f1b", pipeline_ranks=p)))
    if p >= 4 and p % 2 == 0:
        # two pipelines of p/2 stages, each on half the batch: with fewer cores than ranks, two heavy stages busy
        flags = [*schedule_flags("1f1b", pipeline_ranks=p // 2), "--dp", "2", "--n-microbatches", str(max(2, p // 2))]
        runs.append(RunSpec(f"pipeline 1f1b, 2 replicas × {p // 2} stages", "pippy", p, flags))
    return [replace(spec, scaling=True) for spec in runs]


def default_plan(procs: Sequence[int]) -> list[RunSpec]:
    """The benchmark's runs: the scaling runs at every count in `procs`, every other FSDP mode and pipeline
    schedule on MODES_PROCS processes, and the default run in bf16."""
    n, m = max(procs), MODES_PROCS
    plan = [spec for p in procs for spec in _scaling_runs(p, largest=n)]
    plan += [RunSpec(f"fsdp {sharding}", "fsdp", m, ["--sharding", sharding]) for sharding in SHARDINGS[1:]]
    plan.append(RunSpec("fsdp full, a unit per block", "fsdp", m, ["--sharding", "full", "--shard-units", "blocks"]))
    for schedule in SCHEDULES:
        if schedule != "1f1b":
            plan.append(RunSpec(f"pipeline {schedule}", "pippy", m, schedule_flags(schedule, pipeline_ranks=m)))
    # the default run in bf16, all of it: its test accuracy is an acceptance line
    return plan + [RunSpec("ddp", "ddp", n, precision="bf16", launcher="run_ddp.sh", full=True)]


def matmul_peak_gflops(dtype: str, threads: int, *, n: int, repeats: int) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n x n matmul in `dtype` on `threads` CPU threads (torch keeps them)."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]) for _ in "ab")
    a @ b, a @ b  # (warm-up)
    return 2 * n**3 / min(timeit.repeat(lambda: a @ b, number=1, repeat=repeats)) / 1e9


def machine_peaks(*, n: int, repeats: int) -> dict[str, dict[str, float]]:
    """The matmul peak in fp32 and bf16 on 1 and all cores; `peak_gflops`: on all, what a run's % of peak is of."""
    peaks = {
        (d, t): matmul_peak_gflops(d, t, n=n, repeats=repeats) for d in ("fp32", "bf16") for t in sorted({1, CORES})
    }
    by_threads = {f"{d} {t} thread{'s' if t > 1 else ''}": peak for (d, t), peak in peaks.items()}
    return {"peak_by_threads_gflops": by_threads, "peak_gflops": {d: p for (d, t), p in peaks.items() if t == CORES}}


def model_flops(size: str = "baby", dataset: str = "digits") -> dict[str, Any]:
    """Training FLOPs per sample of the layers that have any: backward is twice forward (the gradients of the
    input and of the weights) but for the first layer, whose input (the images) needs no gradient."""
    from common.model_sizes import layers

    counted = [layer for layer in layers(size, dataset) if layer.flops]
    rows = [
        {"layer": layer.name, "forward": layer.flops, "backward": layer.flops * (1 if i == 0 else 2)}
        for i, layer in enumerate(counted)
    ]
    return {"train_flops_per_sample": sum(r["forward"] + r["backward"] for r in rows), "layers": rows}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = Parser("python -m bench", __doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default="runs/bench", help="where bench.json, bench.md and the run folders go")
    add("--procs", default="1,2,4", help="process counts for the scaling runs")
    add("--only", default="", help="comma-separated strategies to launch (baseline,ddp,fsdp,pippy)")
    add("--batch-size", type=int, default=128, help="global batch of every run")
    add("--warmup-steps", type=int, default=3)
    add("--timed-steps", type=int, default=30)
    add("--repeats", type=int, default=0, help="rounds of the scaling runs, a row their median (0: 3; --quick: 1)")
    add("--quick", action="store_true", help="tiny settings: a smoke test of the benchmark itself")
    add("--wait-quiet", type=float, default=0, help="wait up to this many seconds for load < 1 first")
    args = parser.parse(argv)
    args.procs = numbers("--procs", args.procs)  # (before anything is measured)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:  # a smoke test of the benchmark, not a measurement
        args.batch_size, args.warmup_steps, args.timed_steps = 32, 2, 3
    args.peak_n, args.peak_repeats = (512, 3) if args.quick else (2048, 8)  # the matmul peak's size and tries
    return args


def run_one(spec: RunSpec, s: Settings, *, work: Path, attempt: int = 0) -> dict[str, Any]:
    """Launch `spec` once, into work/<its folder>, and return its row."""
    folder = f"{spec.name}_{spec.precision}_x{spec.nproc}" + (f"_launch{attempt}" if attempt else "")
    out = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", folder)
    cmd = spec.command(s, out)
    row = {**asdict(spec), "out": str(out), "command": " ".join(cmd).replace(sys.executable, "python")}
    timed = None if spec.full else s.timed  # the full run: every step after the warm-up
    row |= launch_and_read(cmd, out=out, nproc=spec.nproc, timeout_s=TIMEOUT_S, warmup=s.warmup, timed=timed,
                           batch_size=s.batch_size)  # fmt: skip
    return row | {"ok": "error" not in row}


def launch_all(plan: Sequence[RunSpec], s: Settings, *, work: Path, repeats: int, say: Callable) -> list[dict]:
    """One row per run of `plan`; a `scaling` run's: its median launch of `repeats` rounds (docs/performance.md)."""
    order = [(i, spec) for i in range(repeats) for spec in plan if spec.scaling]
    order += [(0, spec) for spec in plan if not spec.scaling]
    launches: dict[int, list[dict[str, Any]]] = {id(spec): [] for spec in plan}
    for i, spec in order:
        rounds = f", round {i + 1} of {repeats}" if spec.scaling and repeats > 1 else ""
        say(f"{spec.name} {spec.precision} x{spec.nproc} ({spec.launcher}){rounds}")
        row = run_one(spec, s, work=work, attempt=i)
        median_ms = 1e3 * row.get("step_time_s", {}).get("median", 0)
        ran = f"{row.get('samples_per_s', 0):.0f} samples/s, median step {median_ms:.1f} ms"
        say(f"  {ran}" if row["ok"] else f"  failed: {row['error']}")
        launches[id(spec)].append(row)
    rows = []
    for spec in plan:
        attempts = launches[id(spec)]
        done = sorted((a for a in attempts if a["ok"]), key=lambda a: a["samples_per_s"])
        row = done[len(done) // 2] if done else attempts[0]
        if len(attempts) > 1:  # in round order
            row["samples_per_s_of_each_launch"] = [a.get("samples_per_s") for a in attempts]
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    watch = LoadWatch(args.wait_quiet)
    say = lambda message: print(f"[bench {watch.elapsed_s():6.1f} s] {message}", flush=True)
    report: dict[str, Any] = {"settings": dict(vars(args))}
    say("the matmul peak, the model's FLOPs")
    report.update(machine_peaks(n=args.peak_n, repeats=args.peak_repeats))
    report["model"] = model_flops()
    test_size, train_size = (64, 1024) if args.quick else (TEST_SIZE, 0)  # 0: the scripts' default
    settings = Settings(args.batch_size, args.warmup_steps, args.timed_steps, test_size, train_size)
    plan = quick_plan() if args.quick else default_plan(args.procs)
    plan = [spec for spec in plan if not args.only or spec.strategy in args.only.split(",")]
    rows = launch_all(plan, settings, work=out, repeats=args.repeats, say=say)
    annotate(rows, flops_per_sample=report["model"]["train_flops_per_sample"], peaks=report["peak_gflops"])
    report |= {"runs": rows, "scaling": scaling_table(rows)}
    report["machine"] = watch.summary(torch.__version__)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(markdown(report))
    say(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    print(markdown(report))
