"""The least-squares fits of bench.machine's profile: operator rates and per-call costs from timed operators and
steps. numpy only: tests give them made-up timings."""

import itertools
from typing import Any

import numpy as np


def _nonnegative_least_squares(a: Any, b: Any) -> Any:
    """argmin |a x - b| over x >= 0, for the few columns here: the best of the unconstrained fits on every subset of
    columns whose solution is non-negative (the others held at 0)."""
    scale = np.maximum(np.abs(a).max(axis=0), 1e-300)
    a = a / scale
    best, best_error = np.zeros(a.shape[1]), float(np.sum(b**2))
    for k in range(1, a.shape[1] + 1):
        for subset in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, subset], b, rcond=None)
            if (x >= 0).all() and (error := float(np.sum((a[:, subset] @ x - b) ** 2))) < best_error:
                best, best_error = np.zeros(a.shape[1]), error
                best[list(subset)] = x
    return best / scale


def fit(rows: list[tuple[str, int, int, float, int]]) -> dict[str, Any]:
    """From (class, FLOPs, bytes, seconds, calls in the steps) per operator: the overhead per call, FLOP/s per
    class and the memory bandwidth minimising the squared error of each operator's time weighted by its calls
    (so the operators a step spends its time in decide), all non-negative."""
    classes = sorted({c for c, f, *_ in rows if c != "memory" and f})
    columns = ["overhead", *classes, "memory"]
    a, b = np.zeros((len(rows), len(columns))), np.zeros(len(rows))
    for i, (cls, flops, nbytes, seconds, calls) in enumerate(rows):
        weight = calls**0.5
        a[i, 0], b[i] = weight, seconds * weight
        if cls != "memory" and flops:
            a[i, columns.index(cls)] = flops * weight
        else:
            a[i, -1] = nbytes * weight
    solution = _nonnegative_least_squares(a, b)
    inverse = dict(zip(columns, solution))
    rate = lambda x: 1 / x if x > 0 else float("inf")  # noqa: E731
    calls = np.array([r[4] for r in rows]) / np.maximum(a[:, 0], 1e-30)  # (each row's calls over its weight)
    fitted = {"operators": len(rows), "step_seconds_measured": float((b * calls).sum())}
    fitted["step_seconds_fitted"] = float((a @ solution * calls).sum())
    rates = {"flops": {c: rate(inverse[c]) for c in classes}, "memory_bytes_per_s": rate(inverse["memory"])}
    return rates | {"op_overhead_s": float(inverse["overhead"]), "fit": fitted}


def split_overhead(measured: list[tuple[float, int]]) -> dict[str, float]:
    """{"step_overhead_s", "op_overhead_s"} from steps' (seconds beyond their operators, kernel calls): a cost once
    a step (the optimizer's Python, autograd's start) plus one a kernel call, fit over steps of different sizes."""
    a = np.array([[1.0, kernels] for _, kernels in measured])
    once, per_call = _nonnegative_least_squares(a, np.array([seconds for seconds, _ in measured]))
    return {"step_overhead_s": float(once), "op_overhead_s": float(per_call)}


def wrapped_overheads(steps: list[tuple[float, int, Any, tuple[float, int]]], op_overhead_s: float) -> dict[str, float]:
    """{"dtensor_overhead_s", "unit_overhead_s"} from wrapped steps' (seconds beyond their operators, kernel calls,
    count, and those two of their own model's eager step), each less its eager step and `op_overhead_s` a kernel call
    it adds: TP's per DTensor call, FSDP's per unit less its few DTensor calls'. Summed before dividing: a step of
    many calls weighs by its calls."""
    extra = [
        (seconds - eager_seconds - (kernels - eager_kernels) * op_overhead_s, count)
        for seconds, kernels, count, (eager_seconds, eager_kernels) in steps
    ]
    calls = lambda count: sum(count.dtensor_calls.values())  # noqa: E731
    tp = [(seconds, count) for seconds, count in extra if not count.fsdp_units]
    dtensor = max(0.0, sum(seconds for seconds, _ in tp) / sum(calls(count) for _, count in tp))
    fsdp = [(seconds, count) for seconds, count in extra if count.fsdp_units]
    unit = sum(max(0.0, seconds - calls(count) * dtensor) for seconds, count in fsdp)
    return {"dtensor_overhead_s": dtensor, "unit_overhead_s": unit / sum(count.fsdp_units for _, count in fsdp)}
