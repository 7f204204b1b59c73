"""Benchmark: every strategy against a conventional baseline and against the machine's matmul peak.

    python -m bench                      # the default suite (~10 min on 2 cores): runs/bench/bench.{json,md}
    python -m bench --all                # + every mode on 4 processes, more bf16, compile
    python -m bench --wait-quiet 600     # first wait (up to 600 s) until the 1-min load average is < 1
    python -m bench --only ddp,baseline --procs 1,2 --timed-steps 10
    python -m bench --quick              # seconds: tiny settings, for the smoke test

What it does, in this order (each step's code is in the module named):
1. Ceilings (bench/ceilings.py): the matmul peak (a large square matmul, best of several) in fp32 and bf16,
   with 1 thread and with all cores, the ceiling that "achieved FLOP/s" is a fraction of; BabyCNN's training
   FLOPs per sample, counted analytically (forward 2 x MACs of every Conv2d/Linear; backward twice that,
   except the first layer, whose input needs no gradient).
2. In-process measurements (bench/micro.py), each in a fresh process: the fast paths on the single-process
   step, interleaved so that noise hits them alike (channels_last, bf16 autocast, fused AdamW,
   torch.compile); a torch.profiler op table; oneDNN's kernels for conv2; what `train_ddp.py` imports.
3. Launches (bench/plan.py, bench/launches.py): the real scripts (`python train_x.py` for 1 process,
   `python -m torch.distributed.run --standalone --nproc-per-node N train_x.py` otherwise, `bash run_ddp.sh`
   for the default-length runs), and the conventional baseline (bench/baseline.py: DataLoader over a Dataset
   of PIL images with ToTensor + Normalize per sample, DistributedSampler with set_epoch, DDP, default
   threads) at the same global batch and process count. From each run's metrics.jsonl, after --warmup-steps,
   over --timed-steps: samples/s, median step time and its spread; from the launch to the first metrics
   record (polled every 20 ms); each rank's tensor memory (run.json) and peak RSS (/proc VmHWM, polled).
   The 1-process DDP run (and, in the full plan, one rank's share of the largest DDP run) then profiles a
   few more steps: where a step goes, from the script's own profiler spans (bench/breakdown.py).
4. Writes bench.json (everything) and bench.md (the tables the README shows; bench/report.py).

Sub-command used by the in-process measurements: `micro-worker` (one measurement in a fresh process).

Timing on a shared machine is noise: the JSON records the load average before and after, and the
Markdown says when the machine was not quiet. So is a single launch (5-10 % from one to the next): the runs
the acceptance compares go in --repeats rounds, and each ratio to the baseline is also taken round by round.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.ceilings import machine_peaks, model_flops, pipeline_ceiling
from bench.launches import launch_all
from bench.machine import LoadWatch, wait_until_quiet
from bench.micro import measure_in_process, micro_worker
from bench.plan import RunSpec, Settings, default_plan, quick_plan
from bench.report import annotate, markdown, scaling_table


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="runs/bench", help="where bench.json, bench.md and the run folders go")
    parser.add_argument("--procs", default="1,2,4", help="process counts for the scaling runs")
    parser.add_argument("--only", default="", help="comma-separated strategies to launch (baseline,ddp,fsdp,pippy)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch of every run")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="rounds of the runs the acceptance compares (baseline, DDP, FSDP full, pipeline 1F1B at "
        "every process count); each row reports its median launch (0: 3; --quick: 1)",
    )
    parser.add_argument(
        "--modes-procs",
        type=int,
        default=2,
        help="processes for the FSDP modes and pipeline schedules beyond the scaling runs (--all: the most)",
    )
    parser.add_argument(
        "--test-size", type=int, default=256, help="test set of the short runs (evaluated once, after timing)"
    )
    parser.add_argument("--no-full-runs", action="store_true", help="run bf16 DDP short too, not the whole default run")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 launches")
    parser.add_argument(
        "--compile", action="store_true", help="add torch.compile variants to the fast paths (slow to compile)"
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="also FSDP and pipeline in bf16, every mode and schedule "
        "on the most processes, a bf16 profile and --compile",
    )
    parser.add_argument("--micro-only", action="store_true", help="only the in-process measurements, no launches")
    parser.add_argument("--no-micro", action="store_true", help="only the launches, no in-process measurements")
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of the benchmark itself")
    parser.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for load < 1 first")
    parser.add_argument("--timeout-s", type=float, default=300, help="per launch")
    args = parser.parse_args(argv)
    args.compile = args.compile or args.all
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.quick:  # a smoke test of the benchmark, not a measurement
        args.batch_size, args.warmup_steps, args.timed_steps = 32, 2, 3
    # the matmul peak's size and tries, and the data set of the in-process steps (and of the quick launches)
    args.peak_n, args.peak_repeats = (512, 3) if args.quick else (2048, 8)
    args.train_size = 1024 if args.quick else 12800
    return args


def plan_of(args: argparse.Namespace) -> list[RunSpec]:
    procs = [int(p) for p in args.procs.split(",")]
    if args.quick:
        plan = quick_plan()
    else:
        plan = default_plan(
            procs,
            batch_size=args.batch_size,
            modes_procs=max(procs) if args.all else args.modes_procs,
            full_runs=not args.no_full_runs,
            threads_check=True,
            bf16=not args.no_bf16,
            more_bf16=args.all,
        )
    wanted = set(args.only.split(",")) if args.only else None
    return [spec for spec in plan if wanted is None or spec.strategy in wanted]


def summarize(report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """The rows' ratios and FLOP/s, the scaling table, the step breakdowns and the pipeline ceilings."""
    annotate(rows, flops_per_sample=report["model"]["train_flops_per_sample"], peaks=report["peak_gflops"])
    # each breakdown names its run (and command); it is kept once, here, not also in its row
    report["step_breakdown"] = [row.pop("step_breakdown") for row in rows if "step_breakdown" in row]
    report["runs"] = rows
    report["scaling"] = scaling_table(rows)
    report["pipeline_ceiling"] = pipeline_ceiling(
        report["model"]["layers"],
        stage_counts=sorted({r["pipeline"]["stages"] for r in rows if "pipeline" in r}),
        peak_one_thread_gflops=report["peak_by_threads_gflops"]["fp32 1 thread, CPU time"],
    )


def launch_settings(args: argparse.Namespace) -> Settings:
    return Settings(
        batch_size=args.batch_size,
        warmup=args.warmup_steps,
        timed=args.timed_steps,
        test_size=64 if args.quick else args.test_size,
        train_size=args.train_size if args.quick else 0,  # 0: the scripts' default data set (see Settings)
    )


def write_report(report: dict[str, Any], out: Path) -> None:
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(markdown(report))


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["micro-worker"]:
        micro_worker(argv[1:])
        return
    args = parse_args(argv)
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    watch = LoadWatch(quiet_wait=wait_until_quiet(args.wait_quiet) if args.wait_quiet else None)
    say: Callable[[str], None] = lambda message: print(f"[bench {watch.elapsed_s():6.1f} s] {message}", flush=True)
    report: dict[str, Any] = {"settings": dict(vars(args))}

    say("ceilings: matmul peak, model FLOPs")
    report.update(machine_peaks(n=args.peak_n, repeats=args.peak_repeats))
    report["model"] = model_flops()
    if not (args.quick or args.no_micro):  # the smoke test measures nothing in-process
        micro = dict(batch_size=args.batch_size, train_size=args.train_size, compile=args.compile, everything=args.all)
        report.update(measure_in_process(**micro, out=out, say=say))
    rows = []
    if not args.micro_only:
        rows = launch_all(
            plan_of(args), launch_settings(args), work=out, repeats=args.repeats, timeout_s=args.timeout_s, say=say
        )
    summarize(report, rows)
    report["machine"] = watch.summary(torch.__version__)
    write_report(report, out)
    say(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    print(markdown(report))


if __name__ == "__main__":
    main()
