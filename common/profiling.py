"""--profile-steps A:B: torch.profiler over steps A..B, one Chrome trace per rank, and the share of the
time in collectives that computation hid (run.json "profile"). --memory-snapshot adds a CUDA memory
snapshot of the same steps. See docs/profiling.md. Only a run with --profile-steps imports this module
(common/recorder.py); without it the spans are one shared no-op context.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Any, ContextManager, Sequence

import torch
import torch.distributed as dist

_OFF = contextlib.nullcontext()  # reusable: entering it does nothing
# Collectives as the profiler names them: gloo/NCCL run them on their own threads ("gloo:all_reduce",
# "nccl:all_gather" ...); "c10d::" ops are the calls that enqueue them and are neither comm nor compute.
COMM_PREFIXES = ("gloo:", "nccl:")
POINT_TO_POINT = ("gloo:send", "gloo:recv", "nccl:send", "nccl:recv")  # (posted by the thread that computes)
NOT_COMPUTE = ("c10d::", "record_param_comms", "ProfilerStep", "PyTorch Profiler")

Interval = tuple[float, float]


def parse_steps(spec: str) -> tuple[int, int]:
    first, last = (int(x) for x in spec.split(":"))
    return first, last


def union(intervals: Sequence[Interval]) -> list[Interval]:
    """Sorted, non-overlapping intervals covering the same time."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def overlap_s(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Time covered by both sets of intervals."""
    a, b = union(a), union(b)
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def comm_overlap(events: Sequence[dict]) -> dict[str, float]:
    """From one rank's Chrome trace events: seconds in collectives (their union) and how many of those
    seconds some computation ran at the same time on this rank (any operator on a thread that is not a
    communication thread). hidden / comm is the share of communication hidden behind compute."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    comm = [e for e in spans if e["name"].startswith(COMM_PREFIXES)]
    # the threads collectives run on; point-to-point sends show on the thread that posts them, which computes too
    comm_threads = {e.get("tid") for e in comm if not e["name"].startswith(POINT_TO_POINT)}
    compute = [
        e
        for e in spans
        if e.get("cat") == "cpu_op" and e.get("tid") not in comm_threads and not e["name"].startswith(NOT_COMPUTE)
    ]
    as_intervals = lambda es: [(e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in es]  # noqa: E731 (µs -> s)
    comm_s = sum(end - start for start, end in union(as_intervals(comm)))
    return {"comm_s": comm_s, "hidden_s": overlap_s(as_intervals(comm), as_intervals(compute))}


def collectives_by_span(events: Sequence[dict], spans: set[str]) -> dict[str, dict[str, int]]:
    """From one rank's Chrome trace events: how many collectives of each kind ("gloo:all_reduce") began inside
    each of the step's named `spans` ("forward", "backward", ...; "other" outside them), e.g. TP's all-reduces
    in forward and backward, apart from those of the loss and the gradient norm."""
    named = [e for e in events if e.get("ph") == "X" and e.get("name") in spans and "dur" in e]
    counts: dict[str, dict[str, int]] = {}
    for e in events:
        if e.get("ph") != "X" or not e.get("name", "").startswith(COMM_PREFIXES):
            continue
        inside = [s for s in named if s["ts"] <= e["ts"] <= s["ts"] + s["dur"]]
        span = min(inside, key=lambda s: s["dur"])["name"] if inside else "other"  # the innermost
        by_name = counts.setdefault(span, {})
        by_name[e["name"]] = by_name.get(e["name"], 0) + 1
    return counts


# The calls into the process group, as the trace names them (with record_shapes: their tensors' shapes), and the
# argument that holds the tensor whose size the collective is counted by (traffic.py: the gathered output of an
# all-gather, the input of a reduce-scatter)
C10D_OPS = {
    "c10d::allreduce_": ("all_reduce", 0),
    "c10d::_allgather_base_": ("all_gather", 0),
    "c10d::_reduce_scatter_base_": ("reduce_scatter", 1),
    "c10d::allgather_into_tensor_coalesced_": ("all_gather", 0),  # DTensor's (sequence parallel)
    "c10d::reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "c10d::send": ("send", 0),
    "c10d::recv_": ("recv", 0),
    "c10d::broadcast_": ("broadcast", 0),
}


def _numel(dims: list) -> int:
    """Elements of a shape ([8, 64]) or of a list of shapes ([[8, 64], [10]]), as record_shapes writes them."""
    if dims and isinstance(dims[0], list):
        return sum(_numel(d) for d in dims)
    n = 1
    for d in dims:
        n *= d
    return n


def traffic_counted(events: Sequence[dict], steps: int) -> dict[str, dict[str, float]]:
    """From one rank's Chrome trace: per step, the calls and elements of each kind of collective this rank made,
    as traffic.py predicts them. Single numbers (the loss, the gradient norm) are left out: they are not the
    model's traffic. The trace says neither the dtype of a list of tensors nor the group: bytes are predicted."""
    counted: dict[str, dict[str, float]] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("name") not in C10D_OPS:
            continue
        kind, arg = C10D_OPS[e["name"]]
        elements = _numel(e.get("args", {}).get("Input Dims", [[]] * (arg + 1))[arg])
        if elements > 1:
            entry = counted.setdefault(kind, {"calls": 0, "elements": 0})
            entry["calls"] += 1 / steps
            entry["elements"] += elements / steps
    return counted


class StepProfiler:
    """The profiler of one rank over steps [first, last] (both included)."""

    def __init__(self, spec: str, *, out_dir: str, rank: int, device: torch.device, memory: bool = False) -> None:
        self.first, self.last = parse_steps(spec)
        self.out_dir, self.rank, self.device, self.memory = out_dir, rank, device, memory
        self._profiler: Any = None
        self._step_span: Any = None
        self._span_names: set[str] = set()
        self.result: dict[str, Any] | None = None

    def span(self, name: str) -> ContextManager:
        """A named span in the trace while profiling; a no-op otherwise."""
        if self._profiler is None:
            return _OFF
        self._span_names.add(name)
        return torch.profiler.record_function(name)

    def step_start(self, step: int) -> None:
        if step == self.first:
            if self.memory:
                torch.cuda.memory._record_memory_history(max_entries=200_000)
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cpu":  # else kineto (torch 2.14.1) logs "gpuGetDeviceCount failed" without a GPU
                os.environ.setdefault("KINETO_LOG_LEVEL", "5")
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # record_shapes: the collectives' tensor shapes, from which their traffic is counted
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
        if self._profiler is not None:
            self._step_span = torch.profiler.record_function(f"step {step}")
            self._step_span.__enter__()

    def step_end(self, step: int) -> None:
        if self._step_span is not None:
            self._step_span.__exit__(None, None, None)
            self._step_span = None
        if step == self.last:
            self._stop()

    def _stop(self) -> None:
        if self._profiler is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._profiler.stop()
        traces = os.path.join(self.out_dir, "traces")
        os.makedirs(traces, exist_ok=True)
        path = os.path.join(traces, f"rank{self.rank}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        self.result = {
            "rank": self.rank,
            "trace": path,
            **comm_overlap(events),
            "collectives": collectives_by_span(events, self._span_names),
            "traffic": traffic_counted(events, self.last - self.first + 1),
        }
        if self.memory:
            snapshot = os.path.join(self.out_dir, "traces", f"memory_rank{self.rank}.pickle")
            torch.cuda.memory._dump_snapshot(snapshot)
            torch.cuda.memory._record_memory_history(enabled=None)
            self.result["memory_snapshot"] = snapshot

    def report(self) -> dict[str, Any] | None:
        """run.json's "profile" section. Every rank calls it (it gathers)."""
        self._stop()  # the run ended inside the window
        results: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(results, self.result)
        per_rank = [r for r in results if r]
        comm, hidden = sum(r["comm_s"] for r in per_rank), sum(r["hidden_s"] for r in per_rank)
        return {
            "steps": [self.first, self.last],
            "comm_s": comm,
            "comm_hidden_fraction": min(1.0, hidden / comm) if comm > 0 else None,
            "per_rank": per_rank,
            "definition": "comm_s = time in collectives (gloo/NCCL spans, their union per rank) over the profiled "
            "steps, summed over ranks; comm_hidden_fraction = the part of it during which an operator ran on a "
            "compute thread of the same rank, divided by comm_s; per_rank collectives = how many of each kind "
            "began in each span of the profiled steps; per_rank traffic = calls and elements per step of each kind of "
            "collective on tensors of more than one element, to set beside run.json's predicted traffic",
        }
