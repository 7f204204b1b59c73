"""Where a step of a real run goes, read from the Chrome trace that `--profile-steps A:B` writes
(`<out>/traces/rank0.json`). No torch here: the trace is JSON.

In each profiled step the scripts mark spans (`recorder.span(...)` in train_ddp.py; "user_annotation" in the
trace): `step N` is the whole step, from the top of the loop to after its metrics record, and inside it
`data`, `forward`, `backward`, `optimizer` and `metrics` (the recorder writing metrics.jsonl and the console).
What is left of the step, "other", is what the loop does between them: setting the learning rate,
zero_grad, gradient clipping and the loss all-reduce (`global_mean`). The profiler costs some microseconds per
op, so the benchmark profiles only steps after the timed ones.
"""

from __future__ import annotations

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
    once, as forward and backward do with --grad-accum-steps), and "other", the rest of the step."""
    spans = [e for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "dur" in e]
    parts = [e for e in spans if e["name"] in PARTS]
    steps: dict[int, dict[str, float]] = {}
    for step in spans:
        number = _STEP.fullmatch(step["name"])
        if not number:
            continue
        start, end = step["ts"], step["ts"] + step["dur"] + _SLACK_US
        inside = [
            p
            for p in parts
            if (p.get("pid"), p.get("tid")) == (step.get("pid"), step.get("tid")) and start <= p["ts"] <= end - p["dur"]
        ]
        times = {name: sum(p["dur"] for p in inside if p["name"] == name) for name in PARTS}
        times["other"] = max(0.0, step["dur"] - sum(times.values()))
        steps[int(number.group(1))] = {"step": step["dur"], **times}
    return steps


def summarize(steps: dict[int, dict[str, float]]) -> dict[str, Any]:
    """The median ms of the step and of each part, and each part's share of the step time (its total over the
    steps / theirs: the shares sum to 1), leaving out the first profiled step, which pays for starting the
    profiler."""
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
    events = json.loads(trace.read_text())["traceEvents"]
    return {"trace": str(trace), **summarize(step_parts(events))}
