"""Benchmark: every strategy against a conventional baseline and against the machine's matmul peak.

    python -m bench                      # the default suite (~10 min on 2 cores): runs/bench/bench.{json,md}
    python -m bench --all                # + every mode on 4 processes, more bf16
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
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.launches import CORES, LoadWatch, Parser, launch_and_read, numbers
from bench.plan import RunSpec, Settings, default_plan, quick_plan
from bench.report import annotate, markdown, scaling_table


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
    add("--modes-procs", type=int, default=2, help="processes for the other FSDP modes and pipeline schedules")
    add("--test-size", type=int, default=256, help="test set of the short runs (evaluated once, after timing)")
    add("--no-full-runs", action="store_true", help="run bf16 DDP short too, not the whole default run")
    add("--no-bf16", action="store_true", help="skip the bf16 launches")
    add("--all", action="store_true", help="+ FSDP/pipeline in bf16, every mode on the most processes")
    add("--quick", action="store_true", help="tiny settings: a smoke test of the benchmark itself")
    add("--wait-quiet", type=float, default=0, help="wait up to this many seconds for load < 1 first")
    add("--timeout-s", type=float, default=300, help="per launch")
    args = parser.parse(argv)
    args.procs = numbers("--procs", args.procs)  # (before anything is measured)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:  # a smoke test of the benchmark, not a measurement
        args.batch_size, args.warmup_steps, args.timed_steps = 32, 2, 3
    args.peak_n, args.peak_repeats = (512, 3) if args.quick else (2048, 8)  # the matmul peak's size and tries
    return args


def plan_of(args: argparse.Namespace) -> list[RunSpec]:
    modes_procs = max(args.procs) if args.all else args.modes_procs
    runs = dict(modes_procs=modes_procs, full_runs=not args.no_full_runs, bf16=not args.no_bf16, more_bf16=args.all)
    plan = quick_plan() if args.quick else default_plan(args.procs, **runs)
    wanted = set(args.only.split(",")) if args.only else None
    return [spec for spec in plan if wanted is None or spec.strategy in wanted]


def run_one(spec: RunSpec, s: Settings, *, work: Path, timeout_s: float, attempt: int = 0) -> dict[str, Any]:
    """Launch `spec` once, into work/<its folder>, and return its row."""
    folder = f"{spec.name}_{spec.precision}_x{spec.nproc}" + (f"_launch{attempt}" if attempt else "")
    out = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", folder)
    cmd = spec.command(s, out)
    row = {**asdict(spec), "out": str(out), "command": " ".join(cmd).replace(sys.executable, "python")}
    timed = None if spec.full else s.timed  # the full run: every step after the warm-up
    row |= launch_and_read(cmd, out=out, nproc=spec.nproc, timeout_s=timeout_s, warmup=s.warmup, timed=timed,
                           batch_size=s.batch_size)  # fmt: skip
    return row | {"ok": "error" not in row}


def launch_all(
    plan: Sequence[RunSpec], s: Settings, *, work: Path, repeats: int, timeout_s: float, say: Callable
) -> list[dict[str, Any]]:
    """One row per run of `plan`; a `scaling` run's: its median launch of `repeats` rounds (docs/performance.md)."""
    order = [(i, spec) for i in range(repeats) for spec in plan if spec.scaling]
    order += [(0, spec) for spec in plan if not spec.scaling]
    launches: dict[int, list[dict[str, Any]]] = {id(spec): [] for spec in plan}
    for i, spec in order:
        rounds = f", round {i + 1} of {repeats}" if spec.scaling and repeats > 1 else ""
        say(f"{spec.name} {spec.precision} x{spec.nproc} ({spec.launcher}){rounds}")
        row = run_one(spec, s, work=work, timeout_s=timeout_s, attempt=i)
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
    test_size, train_size = (64, 1024) if args.quick else (args.test_size, 0)  # 0: the scripts' default
    settings = Settings(args.batch_size, args.warmup_steps, args.timed_steps, test_size, train_size)
    rows = launch_all(plan_of(args), settings, work=out, repeats=args.repeats, timeout_s=args.timeout_s, say=say)
    annotate(rows, flops_per_sample=report["model"]["train_flops_per_sample"], peaks=report["peak_gflops"])
    report |= {"runs": rows, "scaling": scaling_table(rows)}
    report["machine"] = watch.summary(torch.__version__)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(markdown(report))
    say(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    print(markdown(report))
