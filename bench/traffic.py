"""A run's communication per step: predicted, counted, timed, and the time the collective benchmark predicts
(docs/communication.md reads the table).

    torchrun --standalone --nproc-per-node 4 -m bench.collectives --out runs/collectives   # once per machine
    bash run_fsdp.sh --shard-units blocks --max-steps 6 --profile-steps 3:6 --out runs/fsdp-traffic
    python -m bench.traffic runs/fsdp-traffic --collectives runs/collectives/collectives.json

Per rank and kind of collective: planner/predict.py's prediction, the profiler's count (run.json "profile"), and
the time bench.collectives measured for messages of that size beside the time the backend's spans took per step.
"""

import json
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from bench.launches import Parser, md_table
from common.config import Config
from planner.predict import traffic
from planner.timing import predict_time_s

COLUMNS = ["rank", "collective", "predicted elements", "counted elements", "MB sent", "MB received", "calls"]
COLUMNS += ["benchmark ms", "measured ms"]
BACKEND_SPANS = ("all_reduce", "all_gather", "reduce_scatter")  # the benchmark's op of the same name


def rows(run: dict, results: list[dict] | None) -> list[dict]:
    """One row per rank and kind of collective."""
    profile = run.get("profile") or {}
    counted = {r["rank"]: r for r in profile.get("per_rank", [])}
    steps = (profile["steps"][1] - profile["steps"][0] + 1) if profile else 1
    cfg = Config(**{f.name: run["config"][f.name] for f in fields(Config) if f.name in run["config"]})
    out = []
    for rank in range(run["world_size"]):
        seen = counted.get(rank, {})
        for kind, entry in traffic(cfg, run["world_size"], rank).items():
            count = seen.get("traffic", {}).get(kind, {})
            row = {"rank": rank, "collective": kind, "predicted elements": entry["elements"]}
            row |= {"counted elements": count.get("elements"), "MB sent": entry["bytes_sent"] / 1e6}
            row |= {"MB received": entry["bytes_received"] / 1e6, "calls": count.get("calls")}
            if results and (calls := count.get("calls")) and kind in BACKEND_SPANS:  # each call moves bytes / calls
                row["benchmark ms"] = 1e3 * calls * predict_time_s(results, kind, entry["bytes"] / calls)
            out.append(row)
        if "comm_s" in seen:  # the union of this rank's collective spans, per step (all kinds together)
            out.append({"rank": rank, "collective": "all (measured)", "measured ms": 1e3 * seen["comm_s"] / steps})
    return out


def _read(path: str, hint: str) -> Any:
    from runner.entry import fail

    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        fail(f"cannot read {path} ({e}); {hint}")


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if value.is_integer() else f"{value:.2f}"
    return "-" if value is None else str(value)


def main(argv: list[str] | None = None) -> None:
    parser = Parser("python -m bench.traffic", __doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders with run.json (profiled with --profile-steps for counts)")
    parser.add_argument("--collectives", help="collectives.json of python -m bench.collectives, for the times")
    args = parser.parse(argv)
    results = args.collectives and _read(args.collectives, "run python -m bench.collectives").get("results")
    for path in args.runs:
        run = _read(os.path.join(path, "run.json"), "is this a finished run folder?")
        print(f"{path}: {run['strategy']} on {run['world_size']} ranks")
        print("\n".join(md_table(COLUMNS, ([_cell(row.get(k)) for k in COLUMNS] for row in rows(run, results)))))


if __name__ == "__main__":
    main()
