"""What each training of the shared launches costs: the launches tests/integration/conftest.py would start for the
whole suite, run alone, one after the other, each run timed. A measurement to run by hand before cutting or adding
runs, not a test pytest collects (it takes as long as the launches: ~9 min on a 2-core CPU):

    python -m tests.launch_times                  # prints each launch and its 12 dearest runs
    python -m tests.launch_times --json t.json    # also writes every run's seconds
    python -m tests.launch_times --heavy          # the heavy tier's too (`pytest -m heavy`)

A run's seconds are from the end of the run before it (or the launch's start, for the first, which so also carries
the processes' start) to the last write of its log (a check's, to its folder's newest file). Measured alone, they
add up to what the launches cost the suite, where the tests that start their own processes share the cores.
"""

from __future__ import annotations

import argparse
import importlib
import json
import tempfile
import time
from pathlib import Path
from typing import Sequence

from tests.helpers import ROOT, start_many
from tests.integration.conftest import REFERENCES, Launches, prefix, schedule, without_unmet


def heavy(module) -> bool:
    marks = getattr(module, "pytestmark", [])
    return any(mark.name == "heavy" for mark in (marks if isinstance(marks, list) else [marks]))


def all_runs(*, with_heavy: bool = False) -> dict:
    """Every module's POOLED runs (the heavy tier's modules and runs only `with_heavy`) and the references, named as
    the suite names them; those the installed torch cannot train left out, as the suite leaves them out."""
    runs = {}
    for path in sorted((ROOT / "tests" / "integration").glob("test_*.py")):
        module = importlib.import_module(f"tests.integration.{path.stem}")
        if heavy(module) and not with_heavy:
            continue
        pooled = getattr(module, "POOLED", {}).items()
        runs |= {f"{prefix(module)}/{name}": run for name, run in pooled if with_heavy or not run.heavy}
    return without_unmet(runs)[0] | {f"references/{name}": run for name, run in REFERENCES.items()}


def ended_at(root: Path, name: str) -> float:
    log = root / f"{name}.log"
    return log.stat().st_mtime if log.exists() else max(f.stat().st_mtime for f in (root / name).rglob("*"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.launch_times", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write every launch's runs and seconds here")
    parser.add_argument("--heavy", action="store_true", help="the heavy tier's runs too (pytest -m heavy)")
    args = parser.parse_args(argv)
    plan = schedule(all_runs(with_heavy=args.heavy))
    report = []
    with tempfile.TemporaryDirectory(prefix="launch-times-") as work:
        root = Path(work)
        Launches.prepare(plan, root)  # the folders and aliases, as the suite lays them out
        for nproc, group in plan.launches:
            start = time.time()
            launch = start_many(group, nproc, root)
            printed = launch.communicate()[0]
            if launch.returncode != 0:
                print(printed[-3000:])
                return 1
            took, seconds, before = time.time() - start, {}, start
            for name in group:  # (one after another, in the order the launch trains them)
                end = ended_at(root, name)
                seconds[name], before = end - before, end
            report.append({"nproc": nproc, "seconds": took, "runs": seconds})
            print(f"{nproc} process(es): {len(group)} runs in {took:.0f} s", flush=True)
            for name, s in sorted(seconds.items(), key=lambda item: -item[1])[:12]:
                print(f"  {s:6.1f} s  {name}", flush=True)
    print(f"all launches: {sum(entry['seconds'] for entry in report):.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
