"""A run's communication per step: predicted, counted, timed, and the time the collective benchmark predicts.

    torchrun --standalone --nproc-per-node 4 -m bench.collectives --out runs/collectives   # once per machine
    bash run_fsdp.sh --shard-units blocks --max-steps 6 --profile-steps 3:6 --out runs/fsdp-traffic
    python -m bench.traffic runs/fsdp-traffic --collectives runs/collectives/collectives.json

For each rank and kind of collective: the elements and bytes the planner predicts for the run's configuration
(planner/predict.py), the
elements the profiler counted (run.json "profile"), and, for the collectives that gloo and NCCL run as spans of
their own, the time they took per step beside the time bench.collectives measured for messages of that size.
docs/communication.md reads the table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields

from bench.collectives import predict_time_s
from bench.report import md_table
from common.config import Config
from planner.predict import traffic

COLUMNS = ["rank", "collective", "predicted elements", "counted elements", "MB sent", "MB received", "calls"]
COLUMNS += ["benchmark ms", "measured ms"]
BACKEND_SPANS = {"all_reduce": "all_reduce", "all_gather": "all_gather", "reduce_scatter": "reduce_scatter"}


def rows(run: dict, results: list[dict] | None) -> list[dict]:
    """One row per rank and kind of collective."""
    profile = run.get("profile") or {}
    counted = {r["rank"]: r for r in profile.get("per_rank", [])}
    steps = (profile["steps"][1] - profile["steps"][0] + 1) if profile else 1
    cfg = Config(**{f.name: run["config"][f.name] for f in fields(Config) if f.name in run["config"]})
    out = []
    for rank in range(run["world_size"]):
        predicted = traffic(cfg, run["world_size"], rank)
        seen = counted.get(rank, {})
        for kind, entry in predicted.items():
            calls = seen.get("traffic", {}).get(kind, {}).get("calls")
            row = {
                "rank": rank,
                "collective": kind,
                "predicted elements": entry["elements"],
                "counted elements": seen.get("traffic", {}).get(kind, {}).get("elements"),
                "MB sent": entry["bytes_sent"] / 1e6,
                "MB received": entry["bytes_received"] / 1e6,
                "calls": calls,
            }
            if results and calls and kind in BACKEND_SPANS:  # each call moves bytes / calls (nccl-tests' size)
                row["benchmark ms"] = 1e3 * calls * predict_time_s(results, BACKEND_SPANS[kind], entry["bytes"] / calls)
            out.append(row)
        if "comm_s" in seen:  # the union of this rank's collective spans, per step (all kinds together)
            out.append({"rank": rank, "collective": "all (measured)", "measured ms": 1e3 * seen["comm_s"] / steps})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.traffic", description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders with run.json (profiled with --profile-steps for counts)")
    parser.add_argument("--collectives", help="collectives.json of python -m bench.collectives, for the times")
    args = parser.parse_args(argv)
    results = None
    if args.collectives:
        try:
            with open(args.collectives) as f:
                results = json.load(f)["results"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: --collectives: cannot read {args.collectives} ({e}); run python -m bench.collectives")
    for path in args.runs:
        try:
            with open(os.path.join(path, "run.json")) as f:
                run = json.load(f)
        except (OSError, ValueError) as e:
            sys.exit(f"error: {path}: no readable run.json ({e}); is this a finished run folder?")
        print(f"{path}: {run['strategy']} on {run['world_size']} ranks")
        print("\n".join(md_table(COLUMNS, ([_cell(row.get(k)) for k in COLUMNS] for row in rows(run, results)))))


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.2f}"
    return "-" if value is None else str(value)


if __name__ == "__main__":
    main()
