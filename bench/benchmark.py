"""Benchmark: every strategy against a conventional baseline and against the machine's matmul peak.

    python -m bench                      # the default suite (~10 min on 2 cores): runs/bench/bench.{json,md}
    python -m bench --only ddp,baseline --procs 1,2 --timed-steps 10
    python -m bench --quick              # seconds: tiny settings, for the smoke test
    python -m bench --model gpt --procs 1  # BabyGPT: train_ddp.py against the plain loop (bench/baseline.py)

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

from bench.launches import CORES, LoadWatch, Parser, fmt, launch_and_read, md_table, numbers, torchrun
from common.config import SCHEDULES, SHARDINGS
from common.pipeline_layout import SINGLE_STAGE_SCHEDULES

MODES_PROCS = 2  # processes of the FSDP modes and pipeline schedules beyond the scaling runs
TEST_SIZE, TIMEOUT_S = 256, 300  # the short runs' test set (evaluated once, after timing); seconds per launch
RUN_COLUMNS = ["run", "precision", "procs", "samples/s", "× baseline", "step ms: median (p10–p90)"]
RUN_COLUMNS += ["launch → 1st step s", "tensors/rank MB", "peak RSS/rank MB", "GFLOP/s", "% of peak", "test acc"]


@dataclass(frozen=True)
class Settings:  # what every launch of one benchmark shares
    batch_size: int  # the global batch
    warmup: int  # steps before the timed ones
    timed: int  # the steps that samples/s and the step times are taken over
    test_size: int  # the short runs' test set (evaluated after training)
    train_size: int = 0  # the data set of the short runs; 0: the scripts' default
    model: str = "cnn"  # gpt: BabyGPT in every launch, the baseline's too


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
        own += ["--model", s.model] if s.model != "cnn" else []
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


# the smoke test's launches (--quick)
QUICK_PLAN = [RunSpec("ddp", "ddp", 1, launcher="python"), RunSpec("baseline", "baseline", 2), RunSpec("ddp", "ddp", 2)]


def schedule_flags(schedule: str, *, pipeline_ranks: int) -> list[str]:
    """A pipeline schedule and what its layout needs (common/pipeline_layout.py checks it): one stage per rank
    for gpipe and 1F1B, two for the others; dualpipev at least a micro-batch per stage."""
    if schedule in SINGLE_STAGE_SCHEDULES:
        return ["--schedule", schedule]
    flags = ["--schedule", schedule, "--stages-per-rank", "2"]
    return flags + (["--n-microbatches", str(2 * pipeline_ranks)] if schedule == "dualpipev" else [])


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
    runs = [(d, t) for d in ("fp32", "bf16") for t in sorted({1, CORES})]
    peaks = {(d, t): matmul_peak_gflops(d, t, n=n, repeats=repeats) for d, t in runs}
    by_threads = {f"{d} {t} thread{'s' if t > 1 else ''}": peak for (d, t), peak in peaks.items()}
    return {"peak_by_threads_gflops": by_threads, "peak_gflops": {d: p for (d, t), p in peaks.items() if t == CORES}}


def model_flops(model: str = "cnn") -> dict[str, Any]:
    """Training FLOPs per sample (BabyGPT: a sequence of 64 tokens) of the layers that have any: backward is twice
    forward (the input's and the weights' gradients) but for BabyCNN's first layer, whose input needs no gradient."""
    from common.model_sizes import layers

    counted = [layer for layer in layers("baby", "copy" if model == "gpt" else "digits", model) if layer.flops]
    rows = [
        {"layer": layer.name, "forward": layer.flops, "backward": layer.flops * (1 if i == 0 and model == "cnn" else 2)}
        for i, layer in enumerate(counted)
    ]
    flops = sum(r["forward"] + r["backward"] for r in rows)
    return {"train_flops_per_sample": flops, "layers": rows, **({"seq_len": 64} if model == "gpt" else {})}


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = Parser("python -m bench", __doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default="runs/bench", help="where bench.json, bench.md and the run folders go")
    add("--procs", default="1,2,4", help="process counts for the scaling runs")
    add("--only", default="", help="comma-separated strategies to launch (baseline,ddp,fsdp,pippy)")
    add("--model", default="cnn", choices=("cnn", "gpt"), help="gpt: BabyGPT, the baseline and DDP only, fp32")
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


def _spread(values: Sequence[float] | None, spec: str, what: str) -> str:
    """' (min–max what)' of several values (`what` may name their number, {n}), else ''."""
    values = [v for v in values or [] if v]
    return f" ({min(values):{spec}}–{max(values):{spec}}{what.format(n=len(values))})" if len(values) > 1 else ""


def annotate(rows: list[dict], *, flops_per_sample: float, peaks: dict[str, float]) -> None:
    """Add achieved GFLOP/s, its fraction of the machine's peak, and the ratio to the baseline and of bf16 to its
    fp32 twin, each also round by round."""
    baseline = {r["nproc"]: r for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}  # by procs
    fp32_twin = {(r["name"], r["nproc"], r["launcher"]): r for r in rows if r["precision"] == "fp32"}
    launches = lambda r: r.get("samples_per_s_of_each_launch", [])  # noqa: E731
    each = lambda a, b: [x / y for x, y in zip(launches(a), launches(b)) if x and y]  # noqa: E731 (round by round)
    for row in (row for row in rows if row.get("samples_per_s")):
        row["model_gflops"] = row["samples_per_s"] * flops_per_sample / 1e9
        peak = peaks.get(row["precision"])
        row["peak_fraction"] = row["model_gflops"] / peak if peak else None
        rival = baseline.get(row["nproc"])
        if rival:
            row["vs_baseline"] = row["samples_per_s"] / rival["samples_per_s"]
            ratios = each(row, rival)
            if len(ratios) > 1 and row["strategy"] != "baseline":
                row["vs_baseline_each_round"] = ratios
        twin = fp32_twin.get((row["name"], row["nproc"], row["launcher"]))
        if row["precision"] == "bf16" and twin and twin.get("samples_per_s"):  # the bf16 speed-up, side by side
            row["vs_fp32"] = row["samples_per_s"] / twin["samples_per_s"]
            row["vs_fp32_each_round"] = each(row, twin)


def scaling_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Run name -> process count -> fp32 samples/s of the runs at the benchmark's settings on several counts."""
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("ok") and r["precision"] == "fp32" and r.get("samples_per_s"):
            table.setdefault(r["name"], {})[str(r["nproc"])] = r["samples_per_s"]
    return {k: v for k, v in table.items() if len(v) > 1}


def markdown(report: dict[str, Any]) -> str:
    return "\n".join(line for part in (_header, _runs, _ratios) for line in part(report)) + "\n"


def _section(*paragraphs: str | list[str]) -> list[str]:
    """The lines of a section: each paragraph (a line, or a table's lines) after an empty line."""
    return [line for p in paragraphs for line in ["", *([p] if isinstance(p, str) else p)]]


def _header(report: dict[str, Any]) -> list[str]:
    """The machine and how busy it was, the settings, the matmul peak and the model's FLOPs."""
    m, s, peaks = report["machine"], report["settings"], report["peak_by_threads_gflops"]
    loaded = "" if m["quiet"] else " -- **not quiet: other work shared the cores, the figures are inflated**"
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average (1 min) before: "
        f"{m['load_before'][0]:.2f}; other processes used {m['other_processes_cores']:.2f} cores on average "
        f"during the {m['bench_wall_s']:.0f} s run{loaded}.",
        "",
        f"Global batch {s['batch_size']}; {s['warmup_steps']} warm-up steps, then {s['timed_steps']} timed (the full "
        f"run: all steps after the warm-up). Matmul peak ({s['peak_n']}^3, best of {s['peak_repeats']}): "
        f"{', '.join(f'{k} {v:.0f}' for k, v in peaks.items())} GFLOP/s; a run's % of peak is of the all-cores "
        f"figure in its dtype. Model: {report['model']['train_flops_per_sample'] / 1e6:.1f} MFLOP per sample "
        "(forward + backward)" + (f", a sequence of {t} tokens." if (t := report["model"].get("seq_len")) else "."),
    ]


def _runs(report: dict[str, Any]) -> list[str]:
    mb = lambda values: fmt(max((v for v in values or [] if v), default=None), ".0f", 1e-6)  # the rank's with most
    rows = []
    for r in report["runs"]:
        if not r.get("ok"):
            rows.append([r["name"], r["precision"], r["nproc"], f"failed: {r.get('error', '')[:120]}", *[""] * 8])
            continue
        st, g = r.get("step_time_s"), r.get
        runner = " (`run_ddp.sh`" + (", full run)" if r["full"] else ")") if r["launcher"] == "run_ddp.sh" else ""
        launches = _spread(g("samples_per_s_of_each_launch"), ".0f", " over {n} launches")
        ratio = fmt(g("vs_baseline"), ".2f") + _spread(g("vs_baseline_each_round"), ".2f", " by round")
        step_ms = f"{1e3 * st['median']:.1f} ({1e3 * st['p10']:.0f}–{1e3 * st['p90']:.0f})" if st else "-"
        first = fmt(g("launch_to_first_step_s"), ".1f")
        rows.append([r["name"] + runner, r["precision"], r["nproc"], fmt(g("samples_per_s"), ".0f") + launches])
        rows[-1] += [ratio, step_ms, first, mb(g("tensor_bytes_per_rank")), mb(g("peak_rss_bytes"))]
        rows[-1] += [fmt(g("model_gflops"), ".1f"), fmt(g("peak_fraction") or None, ".1f", 100)]
        rows[-1] += [fmt(g("test_accuracy"), ".2f", 100)]
    return _section(md_table(RUN_COLUMNS, rows)) if rows else []


def _ratios(report: dict[str, Any]) -> list[str]:
    """bf16 against fp32 (by round, where launched in the same rounds), the scaling table, the DataLoader's wait."""
    lines, scaling, seq_len = [], report.get("scaling") or {}, report["model"].get("seq_len")
    for r in (r for r in report["runs"] if seq_len and r["strategy"] != "baseline" and r.get("vs_baseline")):
        tokens, rounds = r["samples_per_s"] * seq_len, _spread(r.get("vs_baseline_each_round"), ".2f", " by round")
        lines += _section(f"BabyGPT's tokens/s on {r['nproc']} proc: {r['name']} {tokens:.0f}, the plain loop "
                          f"{tokens / r['vs_baseline']:.0f}: {r['vs_baseline']:.2f}×{rounds}.")  # fmt: skip
    for r in (r for r in report["runs"] if r.get("vs_fp32")):
        where = f"{r['name']} on {r['nproc']} process{'es' if r['nproc'] > 1 else ''}"
        rounds = _spread(r.get("vs_fp32_each_round"), ".2f", " by round")
        lines += _section(f"bf16 against fp32, {where}: {r['vs_fp32']:.2f}×{rounds}.")
    procs = sorted({p for row in scaling.values() for p in row}, key=int)
    cell = lambda v, one: "-" if v is None else f"{v:.0f}" + (f" ({v / one:.2f}×)" if one else "")
    rows = ([name, *(cell(row.get(p), row.get("1")) for p in procs)] for name, row in scaling.items())
    if scaling:
        table = md_table(["run", *(f"{p} proc" for p in procs)], rows)
        lines += _section("Scaling, fp32 samples/s (× the same run on 1 process):", table)
    base = [r for r in report["runs"] if r["strategy"] == "baseline" and r.get("data_share") is not None]
    waits = ", ".join(f"{r['nproc']} proc {100 * r['data_share']:.0f}%" for r in base)
    return lines + (_section(f"The baseline's DataLoader wait, share of its step time: {waits}.") if base else [])


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
    report["model"] = model_flops(args.model)
    test_size, train_size = (64, 1024) if args.quick else (TEST_SIZE, 0)  # 0: the scripts' default
    settings = Settings(args.batch_size, args.warmup_steps, args.timed_steps, test_size, train_size, args.model)
    plan = QUICK_PLAN if args.quick else default_plan(args.procs)
    if args.model == "gpt":  # the plain loop's rivals: DDP's, round by round (the other strategies: run_all.sh)
        plan = [p for p in plan if p.scaling and p.strategy in ("baseline", "ddp") and p.precision == "fp32"]
    plan = [spec for spec in plan if not args.only or spec.strategy in args.only.split(",")]
    rows = launch_all(plan, settings, work=out, repeats=args.repeats, say=say)
    annotate(rows, flops_per_sample=report["model"]["train_flops_per_sample"], peaks=report["peak_gflops"])
    report |= {"runs": rows, "scaling": scaling_table(rows)}
    report["machine"] = watch.summary(torch.__version__)
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(markdown(report))
    say(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    print(markdown(report))
