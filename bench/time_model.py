"""The planner's time model proved on this machine: each strategy at 1, 2 and 4 processes for BabyCNN at two sizes
and the ViT, launched as a user does, set beside the step the planner predicts for it from its counted fake step
and this machine's profile (planner/timing.py).

    python -m bench.time_model                       # measures the profile first (bench.machine), ~40 min on 2 cores
    python -m bench.time_model --profile runs/machine/profile.json --models cnn:baby --procs 1,2
    python -m bench.time_model --profile runs/machine/profile.json --replan runs/time_model/time_model.json

Writes <out>/time_model.json and time_model.md: per run, predicted and measured samples/s, the error, and the
prediction's parts (compute, communication, bubble); the median and largest |error| over all runs.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
from datetime import date
from pathlib import Path
from typing import Any, Sequence

from bench.launches import CORES, cpu_name, failure, launch, records, timing_stats
from bench.report import fmt, md_table

STRATEGIES = {  # name -> (runner, flags)
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", ["--shard-units", "blocks"]),
    "pipeline": ("pippy", ["--n-microbatches", "4"]),
    "tp": ("tp", []),
}
WARMUP, TIMEOUT_S = 3, 1800


def flags_for(model: str, size: str, strategy: str, steps: int) -> list[str]:
    runner, own = STRATEGIES[strategy]
    common = ["--model", model, "--model-size", size, "--max-steps", str(steps), "--dropout", "0"]
    return [*common, "--train-size", "4096", "--test-size", "128", "--log-every", "1000", *own]


def predicted(cfg: Any, nproc: int, profile: Any) -> dict[str, Any]:
    from planner.plan import time_config

    return {k: v for k, v in time_config(cfg, nproc, profile).to_json().items() if k != "ranks"}


def plan_one(model: str, size: str, strategy: str, nproc: int, *, steps: int, profile: Any) -> dict[str, Any]:
    """A run's row with its prediction, or with why the scripts would not start it ("skipped")."""
    from common.cli import parse_config
    from common.errors import ConfigError
    from runner.layout import check_layout

    runner, _ = STRATEGIES[strategy]
    flags = flags_for(model, size, strategy, steps)
    row: dict[str, Any] = {"model": f"{model} {size}", "strategy": strategy, "nproc": nproc}
    try:
        check_layout(parse_config(runner, flags, world_size=nproc), nproc)
    except (ConfigError, ValueError) as e:
        return {**row, "skipped": str(e)}
    row["command"] = f"NPROC={nproc} bash run_{runner}.sh " + " ".join(flags)
    cfg = parse_config(runner, flags, world_size=nproc)
    row["batch_size"] = cfg.batch_size
    return {**row, "predicted": predicted(cfg, nproc, profile), "rounds": []}


def launch_one(row: dict[str, Any], *, out: Path, steps: int) -> None:
    """One launch of `row`'s run, as a user does: its median step's samples/s joins row["rounds"]."""
    runner, _ = STRATEGIES[row["strategy"]]
    model, size = row["model"].split()
    folder = out / f"{model}-{size}-{row['strategy']}-{row['nproc']}"
    shutil.rmtree(folder, ignore_errors=True)  # a previous launch's: the runner would move it aside
    command = ["bash", f"run_{runner}.sh", *flags_for(model, size, row["strategy"], steps), "--out", str(folder)]
    ended = launch(command, out=folder, nproc=row["nproc"], timeout_s=TIMEOUT_S)
    if ended["returncode"] != 0:
        row["failed"] = failure(folder, ended["returncode"])
        return
    stats = timing_stats(records(folder), warmup=WARMUP, timed=None, batch_size=row["batch_size"])
    # the median step: a step that another process's burst slowed is the machine's, not the model's
    row["rounds"].append(row["batch_size"] / stats["step_time_s"]["median"])
    row.setdefault("stolen", []).append(ended["stolen_share"])  # the hypervisor's share of the cores, per launch


def measured_before(path: str) -> dict[tuple[str, str, int], dict[str, Any]]:
    """{(model, strategy, processes): row} of an earlier report (--replan), or one line saying why it cannot be read."""
    from runner.entry import fail

    try:
        return {(r["model"], r["strategy"], r["nproc"]): r for r in json.loads(Path(path).read_text())["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        fail(f"--replan {path}: not a report of python -m bench.time_model ({type(e).__name__}: {e})")


def finish(row: dict[str, Any]) -> None:
    """The measured samples/s: the median over the rounds (the machine's speed drifts between launches)."""
    if row.get("rounds"):
        row["measured"] = {"samples_per_s": statistics.median(row["rounds"]), "rounds": row["rounds"]}
        row["error"] = row["predicted"]["samples_per_s"] / row["measured"]["samples_per_s"] - 1


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [abs(r["error"]) for r in rows if isinstance(r.get("error"), float)]
    if not errors:
        return {"runs": 0, "median_abs_error": math.nan, "max_abs_error": math.nan}
    return {"runs": len(errors), "median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}


def markdown(rows: list[dict[str, Any]], report: dict[str, Any]) -> str:
    header = ["model", "strategy", "processes", "measured samples/s", "predicted", "error", "spread", "stolen"]
    header += ["compute ms", "communication ms", "bubble"]
    cells = []
    for r in rows:
        if "skipped" in r:
            continue
        p, m = r.get("predicted", {}), r.get("measured", {})
        error = r["error"] if isinstance(r.get("error"), float) else None
        rounds = m.get("rounds") or []
        spread = max(rounds) / min(rounds) - 1 if len(rounds) > 1 else None
        cells.append(
            [
                r["model"],
                r["strategy"],
                r["nproc"],
                fmt(m.get("samples_per_s"), ".0f"),
                fmt(p.get("samples_per_s"), ".0f"),
            ]
            + [fmt(error, "+.0%"), fmt(spread, ".0%"), fmt(max(r["stolen"]) if r.get("stolen") else None, ".1%")]
            + [fmt(p.get("compute_s"), ".1f", 1e3), fmt(p.get("communication_s"), ".1f", 1e3)]
            + [fmt(p.get("bubble"), ".0%") if r["strategy"] == "pipeline" else "-"]
        )
    s = report["summary"]
    lines = [
        f"{date.today()}, {cpu_name()} ({CORES} cores), torch {report['torch']}; `{report['command']}`.",
        "",
        f"Over {s['runs']} runs: median |error| {s['median_abs_error']:.1%}, largest {s['max_abs_error']:.1%}. "
        '"spread": the fastest launch of a run over its slowest, less one (the machine\'s own noise); "stolen": the '
        "largest share of the cores' time the hypervisor gave other guests during one of its launches.",
        "",
        *md_table(header, cells),
        "",
        "Against one process (DDP on 1, the same model): samples/s measured and predicted, and the predicted step's "
        "milliseconds beyond one process's, by cause:",
        "",
        *md_table(
            ["model", "strategy", "processes", "measured", "predicted", "communication", "bubble", "shared cores"]
            + ["call overhead", "rest"],
            against_one_process(rows),
        ),
    ]
    return "\n".join(lines) + "\n"


def against_one_process(rows: list[dict[str, Any]]) -> list[list[Any]]:
    """Per run on several processes: samples/s against one process training the same model (DDP on 1), measured
    and predicted, and where the predicted step's extra time goes: communication no compute hides, a pipeline's
    bubble, the cores shared by more processes than there are, the operators' per-call overhead, and the rest
    (work every rank repeats, work at fewer threads a process)."""
    ones = {r["model"]: r for r in rows if r["strategy"] == "ddp" and r["nproc"] == 1 and "measured" in r}
    cells = []
    for r in rows:
        one = ones.get(r["model"])
        if r["nproc"] == 1 or "measured" not in r or not one:
            continue
        p, p1 = r["predicted"], one["predicted"]
        extra = p["step_s"] - p1["step_s"]
        parts = {
            "communication": p["exposed_s"],
            "bubble": p["bubble_s"],
            "shared cores": p["sharing_s"],
            "call overhead": p["overhead_s"] - p1["overhead_s"],
        }
        parts["rest"] = extra - sum(parts.values())
        measured = r["measured"]["samples_per_s"] / one["measured"]["samples_per_s"]
        predicted = p["samples_per_s"] / p1["samples_per_s"]
        cells.append(
            [r["model"], r["strategy"], r["nproc"], fmt(measured, ".2f"), fmt(predicted, ".2f")]
            + [fmt(v, "+.0f", 1e3) for v in parts.values()]
        )
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.time_model", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="cnn:baby,cnn:small,vit:baby", help="model:size, comma-separated")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated")
    parser.add_argument("--procs", default="1,2,4", help="process counts, comma-separated")
    parser.add_argument("--steps", type=int, default=20, help=f"steps per run (the first {WARMUP} not timed)")
    parser.add_argument("--profile", help="this machine's profile (python -m bench.machine); default: measure it")
    parser.add_argument("--rounds", type=int, default=3, help="launches of each run, interleaved; the median counts")
    parser.add_argument("--out", default="runs/time_model")
    parser.add_argument(
        "--replan", metavar="TIME_MODEL_JSON", help="launch nothing: an earlier report's measured runs, predicted anew"
    )
    args = parser.parse_args(argv)
    from common.versions import NEEDS_PLANNER
    from runner.entry import fail, require_torch

    require_torch(NEEDS_PLANNER, "python -m bench.time_model")
    if args.steps <= WARMUP + 2:
        fail(f"--steps: {args.steps} leaves no timed steps after the first {WARMUP}; use at least {WARMUP + 3}")
    if args.rounds < 1:
        fail(f"--rounds: {args.rounds}; at least 1 launch of each run")
    if args.replan and not args.profile:
        fail("--replan: give the --profile to predict with (python -m bench.machine wrote it)")
    earlier = measured_before(args.replan) if args.replan else {}  # (read before the plans: a bad file fails at once)
    import torch

    from bench.machine import main as measure_machine
    from common.errors import ConfigError
    from planner.timing import load_profile

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    procs = [int(n) for n in args.procs.split(",")]
    if not args.profile:
        measure_machine(["--out", str(out / "machine"), "--procs", args.procs])
    try:
        profile = load_profile(args.profile or str(out / "machine" / "profile.json"))
    except ConfigError as e:
        fail(str(e))
    rows = [
        plan_one(model, size, strategy, nproc, steps=args.steps, profile=profile)
        for model, _, size in (m.partition(":") for m in args.models.split(","))
        for strategy in args.strategies.split(",")
        for nproc in procs
    ]
    if args.replan:  # (a change to the model, or another profile, set beside the very runs measured before)
        for row in rows:
            before = earlier.get((row["model"], row["strategy"], row["nproc"]), {})
            row.update({key: before[key] for key in ("rounds", "stolen", "failed") if key in before})
    for round_ in range(0 if args.replan else args.rounds):  # every run once a round: a slow spell hits all alike
        for row in (r for r in rows if "predicted" in r and "failed" not in r):
            launch_one(row, out=out, steps=args.steps)
            print(f"[time] round {round_ + 1}: {json.dumps({k: v for k, v in row.items() if k != 'command'})}")
    for row in rows:
        finish(row)
    command = " ".join(["python -m bench.time_model", *(argv if argv is not None else sys.argv[1:])])
    report = {"command": command, "torch": torch.__version__, "profile": profile.name, "rows": rows}
    report["summary"] = summary(rows)
    (out / "time_model.json").write_text(json.dumps(report, indent=1))
    (out / "time_model.md").write_text(markdown(rows, report))
    print(markdown(rows, report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
