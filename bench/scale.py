"""Planned against measured: each strategy launched as a user does, beside what the planner says of it: each rank's
memory (the step's peak and the state it holds, against --measure-peak and run.json), the bytes it sends per step
(planner/predict.py) and, with --profile, its speed (planner/timing.py) against samples/s measured.

    python -m bench.scale                            # BabyCNN baby .. large, six strategies on 4 processes
    python -m bench.scale --models vit:baby,vit:small,cnn:baby --procs 2,4 --steps 30 \\
        --strategies ddp,fsdp,tp,tp-sp,fsdp-x-tp,fsdp-x-tp-sp    # what TP costs and buys
    python -m bench.scale --profile runs/machine/profile.json --models cnn:baby,cnn:small,vit:baby \\
        --strategies ddp,fsdp,pipeline,tp --procs 1,2,4 --steps 20 --rounds 3    # the time model on this machine

A run the scripts would not start, or the memory wall refuses, is not launched; the others once a round (a slow
spell hits all alike). Writes scale.json and scale.md in --out (runs/scale).
"""

from __future__ import annotations

import itertools
import json
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.launches import CORES, Parser, cpu_name, fmt, launch_and_read, md_table, numbers
from common.versions import NEEDS_PLANNER
from runner.entry import fail, require_torch

STRATEGIES = {  # name -> (runner, flags); "sp": --sequence-parallel, the ViT's only; "x": FSDP x TP, 2 x 2
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", ["--shard-units", "blocks"]),
    "fsdp-grad-op": ("fsdp", ["--sharding", "grad-op", "--shard-units", "blocks"]),
    "pipeline": ("pippy", []),  # 1F1B, 4 micro-batches
    "tp": ("tp", []),
    "fsdp-x-tp": ("tp", ["--dp", "2"]),  # (the first six: the default)
    "tp-sp": ("tp", ["--sequence-parallel"]),
    "fsdp-x-tp-sp": ("tp", ["--dp", "2", "--sequence-parallel"]),
}
SIZES = ("baby", "small", "medium", "large")  # BabyCNN's, by default: what scale costs
WARMUP, TIMEOUT_S = 3, 3600  # steps not timed; per launch (`large` trains at a few samples per second)


def flags_for(model: str, size: str, strategy: str, steps: int) -> list[str]:
    common = ["--model", model, "--model-size", size, "--max-steps", str(steps), "--measure-peak", "--dropout", "0"]
    return [*common, "--train-size", "4096", "--test-size", "128", "--log-every", "1000", *STRATEGIES[strategy][1]]


def plan_one(model: str, size: str, strategy: str, nproc: int, *, steps: int, profile: Any) -> dict[str, Any]:
    """A run's row with what the planner says of it, or why it is not launched ("skipped", "refused")."""
    from common.cli import parse_config
    from common.errors import ConfigError
    from planner.measure import plan_rank
    from planner.plan import ranks_to_measure
    from planner.predict import total_bytes, traffic
    from planner.timing import predict
    from runner.layout import check_layout
    from runner.memory import check_memory

    runner, flags = STRATEGIES[strategy][0], flags_for(model, size, strategy, steps)
    row: dict[str, Any] = {"model": f"{model} {size}", "strategy": strategy, "nproc": nproc}
    if (model == "cnn" and strategy.endswith("-sp")) or ("-x-" in strategy and nproc < 4):
        return {**row, "skipped": "no tokens to split" if model == "cnn" else "FSDP x TP needs 2 x 2 processes"}
    try:
        cfg = parse_config(runner, flags, world_size=nproc)
        check_layout(cfg, nproc)
    except (ConfigError, ValueError) as e:
        return {**row, "skipped": str(e)}
    ranks = {rank: plan_rank(cfg, nproc, rank, count=bool(profile)) for rank in ranks_to_measure(cfg, nproc)}
    row |= {f"planned_{key}": max(getattr(r, key) for r in ranks.values()) for key in ("peak_bytes", "state_bytes")}
    row["sent_per_step_bytes"] = max(total_bytes(traffic(cfg, nproc, rank)) for rank in range(nproc))
    row["batch_size"] = cfg.batch_size
    row["command"] = f"NPROC={nproc} bash run_{runner}.sh " + " ".join(flags)
    if profile:
        step = predict(cfg, nproc, {rank: r.count for rank, r in ranks.items()}, profile).to_json()
        row["predicted"] = {k: v for k, v in step.items() if k != "ranks"}
    try:
        check_memory(cfg, nproc=nproc, world_size=nproc, on_cpu=True)
    except ConfigError as e:  # the memory wall: what the runner would say, without launching
        return {**row, "refused": str(e)}
    return {**row, "rounds": [], "stolen": []}


def launch_one(row: dict[str, Any], *, out: Path, steps: int) -> None:
    """One launch of `row`'s run, as a user does: its median step's samples/s joins row["rounds"]."""
    model, size = row["model"].split()
    folder = out / f"{model}-{size}-{row['strategy']}-{row['nproc']}"
    command = ["bash", f"run_{STRATEGIES[row['strategy']][0]}.sh", *flags_for(model, size, row["strategy"], steps)]
    ran = launch_and_read([*command, "--out", str(folder)], out=folder, nproc=row["nproc"], timeout_s=TIMEOUT_S,
                          warmup=WARMUP, timed=None, batch_size=row["batch_size"])  # fmt: skip
    row["stolen"].append(ran["stolen_share"])  # the hypervisor's share of the cores' time, per launch
    if "error" in ran:
        row["failed"] = ran["error"]
        return
    # the median step: a step that another process's burst slowed is the machine's, not the model's
    row["rounds"].append(row["batch_size"] / ran["step_time_s"]["median"])
    row["measured_peak_bytes"] = max(filter(None, ran["peak_bytes_per_rank"]), default=None)  # (--measure-peak's)
    row["measured_state_bytes"] = max(ran["tensor_bytes_per_rank"])
    row["samples_per_s"] = statistics.median(row["rounds"])  # (so far: the median over the rounds)
    if "predicted" in row:
        row["error"] = row["predicted"]["samples_per_s"] / row["samples_per_s"] - 1


def _cell(key: str, spec: str, scale: float) -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt(r.get(key), spec, scale)


COLUMNS: list[tuple[str, Callable[[dict[str, Any]], object]]] = [
    ("model", lambda r: r["model"]),
    ("strategy", lambda r: r["strategy"]),
    ("processes", lambda r: r["nproc"]),
    ("samples/s", lambda r: fmt(r.get("samples_per_s"), ".0f")),
    ("predicted", lambda r: fmt(r["predicted"]["samples_per_s"], ".0f")),
    ("error", lambda r: fmt(r.get("error"), "+.0%")),
    ("spread", lambda r: fmt(max(r["rounds"]) / min(r["rounds"]) - 1 if len(r.get("rounds", ())) > 1 else None, ".0%")),
    ("stolen", lambda r: fmt(max(r.get("stolen", []), default=None), ".1%")),
    ("compute ms", lambda r: fmt(r["predicted"]["compute_s"], ".1f", 1e3)),
    ("communication ms", lambda r: fmt(r["predicted"]["communication_s"], ".1f", 1e3)),
    ("bubble", lambda r: fmt(r["predicted"]["bubble"], ".0%") if r["strategy"] == "pipeline" else "-"),
    ("peak GB planned", _cell("planned_peak_bytes", ".3f", 1e-9)),
    ("measured", _cell("measured_peak_bytes", ".3f", 1e-9)),
    ("state GB planned", _cell("planned_state_bytes", ".3f", 1e-9)),
    ("measured", _cell("measured_state_bytes", ".3f", 1e-9)),
    ("sent per step MB", _cell("sent_per_step_bytes", ".1f", 1e-6)),
    ("", lambda r: (r.get("refused") or r.get("failed") or "")[:140]),
]
TIME_COLUMNS = ("predicted", "error", "compute ms", "communication ms", "bubble")  # with --profile only
NOISE = '"spread": a run\'s fastest launch over its slowest, less one; "stolen": the largest share of the cores\' time '
NOISE += "the hypervisor gave other guests during one of its launches."


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows if "error" in r]
    found = {"runs": len(errors)}
    return found | ({"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)} if errors else {})


def markdown(report: dict[str, Any]) -> str:
    rows, s = [r for r in report["rows"] if "skipped" not in r], report["summary"]
    columns = [(t, cell) for t, cell in COLUMNS if report["profile"] or t not in TIME_COLUMNS]
    lines = [f"{report['date']}, {report['machine']}, torch {report['torch']}; `{report['command']}`.", ""]
    if s["runs"]:
        errors = f"median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%}"
        lines += [f"Over {s['runs']} runs: {errors} (profile: {report['profile']}). {NOISE}", ""]
    lines += ["Memory per rank: the rank that needs the most, planned by python -m planner and measured.", ""]
    return "\n".join([*lines, *md_table([t for t, _ in columns], ([c(r) for _, c in columns] for r in rows))]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser("python -m bench.scale", __doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(f"cnn:{size}" for size in SIZES), help="model:size, ...")
    parser.add_argument("--strategies", default=",".join(list(STRATEGIES)[:6]), help=",".join(STRATEGIES))
    parser.add_argument("--procs", default="4", help="process counts, comma-separated")
    parser.add_argument("--steps", type=int, default=6, help=f"steps per run (the first {WARMUP} not timed)")
    parser.add_argument("--rounds", type=int, default=1, help="launches of each run, interleaved; the median counts")
    parser.add_argument("--profile", help="a profile (python -m bench.machine) to predict each run's speed with")
    parser.add_argument("--out", default="runs/scale")
    args = parser.parse(argv)
    require_torch(NEEDS_PLANNER, "python -m bench.scale")  # it plans each run
    procs, models = numbers("--procs", args.procs), [m.split(":") for m in args.models.split(",")]
    if args.steps < WARMUP + 3 or args.rounds < 1:
        fail(f"--steps {args.steps} --rounds {args.rounds}: at least {WARMUP + 3} steps and 1 round")
    if bad := [m for m in models if len(m) != 2] or [s for s in args.strategies.split(",") if s not in STRATEGIES]:
        fail(f"--models or --strategies: {bad[0]}; a model is model:size, a strategy one of {','.join(STRATEGIES)}")
    import torch

    from common.errors import ConfigError
    from planner.timing import load_profile

    try:
        profile = load_profile(args.profile) if args.profile else None
    except ConfigError as e:
        fail(str(e))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for (model, size), strategy, nproc in itertools.product(models, args.strategies.split(","), procs):
        print(f"[scale] planning {model} {size} {strategy} on {nproc}", flush=True)
        rows.append(plan_one(model, size, strategy, nproc, steps=args.steps, profile=profile))
    for round_ in range(args.rounds):  # every run once a round
        for row in (r for r in rows if "rounds" in r and "failed" not in r):
            launch_one(row, out=out, steps=args.steps)
            print(f"[scale] round {round_ + 1}: {json.dumps({k: v for k, v in row.items() if k != 'command'})}")
    command = " ".join(["python -m bench.scale", *(argv if argv is not None else sys.argv[1:])])
    report = {"command": command, "date": str(date.today()), "machine": f"{cpu_name()} ({CORES} cores)"}
    report |= {"torch": torch.__version__, "profile": profile and profile.name, "rows": rows, "summary": summary(rows)}
    (out / "scale.json").write_text(json.dumps(report, indent=1))
    (out / "scale.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
