"""Where a step of a real run goes (docs/performance.md), read from the Chrome trace that `--profile-steps A:B`
writes: the `step N` span the scripts mark (`recorder.span`) and the parts inside it; "other" is the rest of the
step. No torch here: the trace is JSON."""

import json
import re
import statistics
from pathlib import Path
from typing import Any, Iterable

PARTS = ("data", "forward", "backward", "optimizer", "metrics")
SHARES = (*PARTS, "other")
_STEP = re.compile(r"step (\d+)")
_SLACK_US = 1.0  # the trace's µs timestamps are rounded: a child may seem to end a hair after its step


def step_parts(events: Iterable[dict[str, Any]]) -> dict[int, dict[str, float]]:
    """Step number -> µs of the whole step ("step"), of each part in PARTS (summed, if a part runs more than
    once, as with --grad-accum-steps), and "other", the rest of the step."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "dur" in e]
    steps: dict[int, dict[str, float]] = {}
    for step in spans:
        number = _STEP.fullmatch(step["name"])
        if not number:
            continue
        start, end, thread = step["ts"], step["ts"] + step["dur"] + _SLACK_US, (step.get("pid"), step.get("tid"))
        inside = [p for p in spans if (p.get("pid"), p.get("tid")) == thread and start <= p["ts"] <= end - p["dur"]]
        times = {name: sum(p["dur"] for p in inside if p["name"] == name) for name in PARTS}
        times["other"] = max(0.0, step["dur"] - sum(times.values()))
        steps[int(number.group(1))] = {"step": step["dur"], **times}
    return steps


def summarize(steps: dict[int, dict[str, float]]) -> dict[str, Any]:
    """The median ms of the step and each part, and each part's share of the step time, but for the first step."""
    kept = sorted(steps)[1:]
    if not kept:
        raise ValueError(f"a breakdown needs at least two profiled steps, the trace has {len(steps)}")
    total = sum(steps[s][name] for s in kept for name in SHARES)
    return {
        "steps": kept,
        "median_ms": {name: statistics.median(steps[s][name] for s in kept) / 1e3 for name in ("step", *SHARES)},
        "share": {name: sum(steps[s][name] for s in kept) / total for name in SHARES},
    }


def trace_breakdown(trace: Path) -> dict[str, Any]:
    """summarize(step_parts(...)) of one rank's Chrome trace, with the trace's path."""
    return {"trace": str(trace), **summarize(step_parts(json.loads(trace.read_text())["traceEvents"]))}
