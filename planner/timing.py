"""Time on the plan: a training step's time per rank, predicted from the planner's counted fake step
(planner/count.py) and a machine profile (planner/profiles/: published figures for GPUs, or this machine's, measured
by `python -m bench.machine`). docs/time.md says how to read it.

- **Compute**: every operator the step ran, `calls x (work + overhead)`: its work as the profile timed that very
  call, else `max(FLOPs / achievable FLOP/s, bytes / memory bandwidth)` at its class's rate (a matmul, a
  convolution, attention); its overhead what an eager call in forward or backward costs besides (its module,
  autograd; on a GPU the host's launch of any kernel, hidden by work that takes longer); once a step what the
  optimizer and autograd's start cost in Python, each DTensor call's dispatch and each FSDP unit's hooks, where
  the profile measured them. On a CPU, the first touch of each storage of 32 MiB or more the step makes
  (Op.fresh_bytes: glibc maps it afresh), and ranks that share the cores more than once (4 processes on 2) get
  their share.
- **Communication**: every collective at its size on the links its group spans: on a GPU the profile's bus
  bandwidth (nccl-tests' definition) within a node or across the network, plus a latency per call; on this machine
  the time measured for that collective, size and group (bench.collectives' table, interpolated), plus what a
  collective costs a step after its compute beyond that back-to-back time, where the profile measured it: by the
  compute its rank ran since its previous collective (Collective.before), on the profile's curve.
- **Overlap**: on a GPU, collectives run beside compute on their own stream: DDP's bucket all-reduces beside the
  rest of backward, FSDP's prefetched all-gathers beside the previous unit, its reduce-scatters beside the next; n
  chunks of compute C and communication A overlapped take max(C + A / n, A + C / n) (one chunk of each is
  exposed). TP's collectives and the numbers logged after backward are on the critical path. On a CPU gloo
  reduces on the cores that compute: nothing hides.
- **The pipeline**: each rank's stage actions in the order its schedule ran them (the fake step's own order), each
  costing its operators; the activation or gradient it sends delays the action that receives it, not the sender
  (a send is asynchronous: `isend`); simulated together (common/pipeline_actions.py), the makespan holds the bubble
  and the waits for what was sent.
"""

from __future__ import annotations

import bisect
import json
import math
import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from planner.count import DTENSOR_CALL, Collective, Op, StepCount

PROFILES = Path(__file__).resolve().parent / "profiles"
MATMULS = ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten._scaled_mm")
CONVOLUTIONS = ("aten.convolution", "aten._convolution", "aten.convolution_backward", "aten._slow_conv2d_forward")
# Operators that only relabel memory (a view, a transpose, autograd's detach): no kernel, and none of what an eager
# call costs besides (Python, the modules, autograd's bookkeeping) is theirs; they take what timing them took
VIEWS = {
    f"aten.{name}"
    for name in (
        "view _unsafe_view _reshape_alias t transpose permute expand unsqueeze squeeze slice select alias as_strided "
        "detach split split_with_sizes unbind lift_fresh"
    ).split()
} | {"profiler._record_function_enter_new", "profiler._record_function_exit"}
ALLOCATIONS = {f"aten.{name}" for name in "empty empty_strided new_empty new_empty_strided empty_like".split()}
BUS_FACTOR = {  # nccl-tests' busbw / algbw on n ranks: the share of the size each rank sends
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "send": lambda n: 1.0,
    "all_to_all": lambda n: (n - 1) / n,  # (expert parallelism's: each rank keeps 1 / n of what it sends)
}


def op_class(name: str) -> str:
    """The class whose achievable FLOP/s an operator runs at: matmul, conv, attention, or memory (no FLOPs)."""
    if name in MATMULS:
        return "matmul"
    if name in CONVOLUTIONS:
        return "conv"
    return "attention" if "attention" in name else "memory"


def operator_key(op: Op) -> str:
    """How a profile's table names one kind of operator call: its signature (name, overload, the arguments that are
    not tensors), its tensors' shapes, its dtype."""
    return f"{op.signature}{list(map(list, op.shapes))}{op.dtype}"


@dataclass
class Compute:
    """What one rank computes at: FLOP/s by operator class ("matmul", or "matmul:bf16" for one dtype), memory
    bandwidth, and the time each operator call costs besides its work: on a CPU added to it, on a GPU the host's
    time to launch it, which runs ahead of the device's (an operator takes the longer of the two)."""

    flops: dict[str, float]
    memory_bytes_per_s: float
    op_overhead_s: float
    launch_overlaps: bool = False
    operators: dict[str, float] = field(default_factory=dict)  # operator_key -> seconds, as this machine timed them
    alone_overhead_s: float = 0.0  # what timing an operator alone cost besides its work (the fit's constant)
    step_overhead_s: float = 0.0  # what an eager step costs once besides its operators' calls (the optimizer's)
    dtensor_overhead_s: float = 0.0  # a DTensor call's dispatch in Python, besides its shards' operators
    unit_overhead_s: float = 0.0  # an FSDP unit's hooks in Python, a step (forward and backward)
    # how fast the OS hands a process pages it has not touched yet: a CPU's buffers of MMAP_THRESHOLD or more are
    # mapped afresh at every allocation (Op.fresh_bytes); none on a GPU (the caching allocator keeps its blocks)
    fresh_bytes_per_s: float = 0.0

    def op_parts(self, op: Op) -> tuple[float, float]:
        """(one call's work in seconds, what the call adds besides: its overhead, or on a GPU the part of the launch
        that the work does not hide). The profile's own timing of this very call if it has one, else its FLOPs at
        its class's rate or its bytes at the memory bandwidth, whichever is longer (plus the fitted cost per call
        of an operator timed alone); a view or an allocation moves no data. Plus the first touch of the large
        storages it makes (the profile's operators are timed on pages already mapped)."""
        timed = self.operators.get(operator_key(op)) if self.operators else None
        if timed is not None:
            work = timed
        elif op.name in VIEWS or op.name in ALLOCATIONS:
            work = 0.0
        else:
            cls = op_class(op.name)
            rate = (self.flops.get(f"{cls}:{op.dtype}") or self.flops.get(cls)) if op.flops else None
            work = self.alone_overhead_s + max(op.flops / rate if rate else 0.0, op.bytes / self.memory_bytes_per_s)
        if self.fresh_bytes_per_s:
            work += op.fresh_bytes / self.fresh_bytes_per_s
        if self.launch_overlaps:  # a GPU: the host launches every kernel, the optimizer's too
            return work, max(0.0, (0.0 if op.name in VIEWS else self.op_overhead_s) - work)
        return work, self.op_overhead_s if pays_call_cost(op) else 0.0

    def op_time(self, op: Op) -> float:
        return sum(self.op_parts(op))


def pays_call_cost(op: Op) -> bool:
    """Whether a CPU charges `op`'s calls what an eager call costs beyond its work (its module's Python, autograd's
    node): a kernel's call in forward or backward. Not a view's (no kernel: its cost is its timed one), nor the
    optimizer's and the gradient norm's, which run in plain no-grad Python that timing the operator alone already
    pays (the ViT's gradient norm, 417 calls: 1.7 ms, its operators alone 1.8 ms,
    docs/benchmarks/2026-12-02-zen4-2core-time-model.md). The profile's fit counts the same calls (bench/machine.py:
    beyond_operators)."""
    return op.name not in VIEWS and op.phase != "optimizer"


def nearest(measured: Iterable[int], n: int) -> int:
    """The size measured nearest to `n` (threads, ranks in a group); between two as near, the larger."""
    return min(measured, key=lambda m: (abs(m - n), -m))


@dataclass
class Profile:
    """A machine: how fast one rank computes and how fast its collectives are. `kind` "gpu": one rank per device,
    `devices_per_node` per node, `links` {"node", "network"}: {"busbw_bytes_per_s", "latency_s"}. `kind` "cpu":
    `cores` shared by the ranks, compute by threads per rank, `collectives` {group size: bench.collectives rows}
    (none: a machine measured for one process), `after_compute` {group size: [(seconds of compute before it,
    seconds a collective costs after that compute beyond its row's), ...], bench.collectives --after-compute; one
    point: that cost whatever the compute, as a profile measured before the curve says}."""

    name: str
    kind: str
    compute: dict[int, Compute]  # threads per rank (a GPU: 1) -> Compute
    peak_flops: dict[str, float]  # dtype -> the device's (a CPU's: all cores') dense peak, for MFU
    devices_per_node: int = 1
    cores: int = 1
    links: dict[str, dict[str, float]] = field(default_factory=dict)
    collectives: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    after_compute: dict[int, list[tuple[float, float]]] = field(default_factory=dict)
    overlap: bool = False
    sources: dict[str, str] = field(default_factory=dict)

    def peak(self, precision: str) -> float:
        """The dense peak FLOP/s MFU is against: the run's dtype's, else the profile's fp32 one."""
        return self.peak_flops.get(precision) or self.peak_flops["fp32"]

    def threads(self, procs_per_node: int) -> int:
        """The threads each process runs (common/distributed.py: cores / local processes, at least 1)."""
        return 1 if self.kind == "gpu" else max(1, self.cores // procs_per_node)

    def for_threads(self, threads: int) -> Compute:
        return self.compute[nearest(self.compute, threads)]

    def after_compute_time(self, group_size: int, compute_s: float) -> float:
        """What a CPU collective of `group_size` ranks costs beyond its back-to-back time when its rank computed
        `compute_s` since its previous one: the first rank there waits for the last, the peers' gloo threads are
        woken on cores the compute holds. On the curve of the group size measured nearest: none after no compute
        (back to back is the table's), linear between the points, the last point's beyond it; never below zero."""
        if not self.after_compute or group_size < 2:
            return 0.0
        points = sorted(self.after_compute[nearest(self.after_compute, group_size)])
        if len(points) == 1:  # (one figure for every collective)
            return max(0.0, points[0][1])
        x0, y0 = 0.0, 0.0
        for x1, y1 in points:
            if compute_s <= x1:
                return max(0.0, y0 + (y1 - y0) * (compute_s - x0) / (x1 - x0) if x1 > x0 else y1)
            x0, y0 = x1, y1
        return max(0.0, y0)

    def collective_time(self, c: Collective, compute_before_s: float = 0.0) -> float:
        """One collective's seconds: its bytes over the links its group spans (a GPU), or as measured here, after
        `compute_before_s` of its rank's compute (after_compute_time)."""
        kind = "send" if c.kind in ("send", "recv") else c.kind
        if c.kind == "recv":
            return 0.0  # a transfer is counted once, at its sender; the receiver waits for it in the schedule
        if self.kind == "cpu":
            # gloo has no reduce-scatter of its own for DTensor's functional collective: it all-reduces the whole
            # tensor (docs/tp.md)
            kind = "all_reduce" if c.functional and kind == "reduce_scatter" else kind
            # a step's collective follows compute: the peers' gloo threads woken on cores their compute holds, the
            # first rank waiting for the last (bench.collectives --after-compute)
            after = self.after_compute_time(c.group_size, compute_before_s)
            return self._measured_time(kind, c.group_size, c.bytes) + after
        first, stride = c.first_and_stride
        spans = (first + (c.group_size - 1) * stride) // self.devices_per_node != first // self.devices_per_node
        link = self.links["network" if spans else "node"]
        # latency: a ring's steps, or for large groups a tree's (NCCL picks the tree where its latency is lower)
        n = c.group_size
        steps = 1 if kind == "send" else min(n - 1, 2 * math.ceil(math.log2(n))) * (2 if kind == "all_reduce" else 1)
        return steps * link["latency_s"] + c.bytes * BUS_FACTOR[kind](n) / link["busbw_bytes_per_s"]

    def _measured_time(self, kind: str, ranks: int, nbytes: int) -> float:
        op = "send_recv" if kind == "send" else kind
        sizes = [n for n, rows in self.collectives.items() if any(r["op"] == op for r in rows)]
        if not nbytes:
            return 0.0
        if not sizes:
            raise ConfigError(
                f"--profile: {self.name} has no {op} measured on {ranks} processes: python -m bench.machine --procs"
            )
        measured = nearest(sizes, ranks)
        rows = sorted((r for r in self.collectives[measured] if r["op"] == op), key=lambda r: r["bytes"])
        # each size between two others at the median of the three: a time that rises with the size stays as it is,
        # one size this VM's noise put out of line does not decide every collective of that size (TP's all-reduces)
        rows = [
            {**r, "time_s": statistics.median(n["time_s"] for n in rows[i - 1 : i + 2])} if 0 < i < len(rows) - 1 else r
            for i, r in enumerate(rows)
        ]
        largest = max(rows, key=lambda r: r["bytes"])
        if nbytes > largest["bytes"]:  # beyond what was measured: at the largest size's bandwidth
            seconds = largest["time_s"] * nbytes / largest["bytes"]
        else:
            seconds = predict_time_s(rows, op, nbytes)
        # a group size not measured: the same bus bandwidth at the measured one's
        return seconds * BUS_FACTOR[kind](ranks) / BUS_FACTOR[kind](measured)


def predict_time_s(results: list[dict[str, Any]], op: str, size_bytes: float) -> float:
    """The time of one `op` of `size_bytes` (nccl-tests' size) from collectives.json's "results": log-log between the
    measured sizes around it, else the nearest end's (clamped: measure up to the sizes you ask about). No torch."""
    points = sorted((float(r["bytes"]), float(r["time_s"])) for r in results if r["op"] == op)
    if not points:
        raise ValueError(f"no rows for op {op!r}; the results hold {sorted({r['op'] for r in results})}")
    if not size_bytes > 0:
        raise ValueError(f"size_bytes must be positive, got {size_bytes}")
    i = bisect.bisect_left([size for size, _ in points], size_bytes)
    if i == 0 or i == len(points) or points[i][0] == size_bytes:  # at or outside the ends, or a measured size
        return points[min(i, len(points) - 1)][1]
    (size_hi, time_hi), (size_lo, time_lo) = points[i], points[i - 1]
    fraction = math.log(size_bytes / size_lo) / math.log(size_hi / size_lo)
    return math.exp(math.log(time_lo) + fraction * math.log(time_hi / time_lo))


def _curve(written: Any) -> list[tuple[float, float]]:
    """collective_after_compute_s's value: [[compute seconds, extra seconds], ...], or one number (a profile measured
    before the curve: that cost whatever the compute)."""
    if isinstance(written, (int, float)):
        return [(0.008, float(written))]  # (bench.collectives timed it after 8 ms)
    return [(float(c), float(e)) for c, e in written]


def load_profile(name: str) -> Profile:
    """A profile by name (planner/profiles/<name>.json) or path; ConfigError, one line, naming what is wrong."""
    path = Path(name) if name.endswith(".json") or "/" in name else PROFILES / f"{name}.json"
    known = ", ".join(sorted(p.stem for p in PROFILES.glob("*.json")))
    if not path.exists():
        raise ConfigError(
            f"--profile: no profile {name!r}; use one of {known}, or a file python -m bench.machine wrote"
        )
    try:
        data = json.loads(path.read_text())
        if data["kind"] not in ("cpu", "gpu"):
            raise ValueError(f"kind {data['kind']!r}: cpu or gpu")
        gpu = data["kind"] == "gpu"
        if gpu and not {"node", "network"} <= set(data["links"]):
            raise ValueError("a GPU's links: node and network, each busbw_bytes_per_s and latency_s")
        if "fp32" not in data["peak_flops"]:
            raise ValueError("peak_flops: {dtype: FLOP/s}, fp32 among them")
        numbers = [*data["peak_flops"].values(), *(c["memory_bytes_per_s"] for c in data["compute"].values())]
        numbers += [link[k] for link in data.get("links", {}).values() for k in ("busbw_bytes_per_s", "latency_s")]
        if not data["compute"] or not all(isinstance(n, (int, float)) and n >= 0 for n in numbers):
            raise ValueError("compute by threads, its rates and the links' positive numbers")
        compute = {
            int(threads): Compute(
                c["flops"],
                float(c["memory_bytes_per_s"]),
                float(c["op_overhead_s"]),
                gpu,
                c.get("operators", {}),
                float(c.get("alone_overhead_s", 0.0)),
                float(c.get("step_overhead_s", 0.0)),
                float(c.get("dtensor_overhead_s", 0.0)),
                float(c.get("unit_overhead_s", 0.0)),
                float(c.get("fresh_bytes_per_s", 0.0)),
            )
            for threads, c in data["compute"].items()
        }
        return Profile(
            name=data["name"],
            kind=data["kind"],
            compute=compute,
            peak_flops={dtype: float(value) for dtype, value in data["peak_flops"].items()},
            devices_per_node=int(data.get("devices_per_node", 1)),
            cores=int(data.get("cores", 1)),
            links=data.get("links", {}),
            collectives={int(n): rows for n, rows in data.get("collectives", {}).items()},
            after_compute={int(n): _curve(s) for n, s in data.get("collective_after_compute_s", {}).items()},
            overlap=bool(data.get("overlap", False)),
            sources=data.get("sources", {}),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        what = f"{type(e).__name__}: {e}" if not isinstance(e, json.JSONDecodeError) else f"not JSON ({e})"
        raise ConfigError(f"--profile: {path} is not a machine profile ({what}); see docs/time.md, Profiles") from None


@dataclass
class RankTime:
    """One rank's step, in seconds: compute and communication by phase, what of the communication is exposed."""

    rank: int
    compute: dict[str, float]
    communication: dict[str, float]
    exposed: dict[str, float]
    step_s: float
    bubble_s: float = 0.0
    overhead_s: float = 0.0  # of compute: what the operators' calls cost besides their work
    sharing_s: float = 0.0  # of compute: what processes that share the cores (on a CPU) wait for theirs


def _phase_time(compute: float, hidden: float, exposed: float, chunks: int) -> float:
    """A phase's seconds: `compute`, the communication that runs beside it (`hidden`, in `chunks` pieces: n chunks
    of compute C and communication A take max(C + A / n, A + C / n), one end of each exposed) and the
    communication that waits for it (`exposed`)."""
    if hidden:
        chunks = max(chunks, 1)
        compute = max(compute + hidden / chunks, hidden + compute / chunks)
    return compute + exposed


def _compute_before(c: Collective, ops: dict[tuple, Op], compute_at: Compute, share: float) -> float:
    """The seconds its rank computed since its previous collective (Collective.before), sharing the cores `share`."""
    seconds = 0.0
    for key, calls in c.before:
        if key == DTENSOR_CALL:
            seconds += calls * compute_at.dtensor_overhead_s
        elif (op := ops.get(key)) is not None:
            seconds += calls * compute_at.op_time(op)
    return seconds * share


def _share(profile: Profile, procs_per_node: int, threads: int) -> float:
    """How many times over the ranks that compute at once hold a CPU's cores (4 processes on 2: twice)."""
    return max(1.0, procs_per_node * threads / profile.cores) if profile.kind == "cpu" else 1.0


def rank_time(
    count: StepCount,
    profile: Profile,
    *,
    procs_per_node: int,
    rank: int = 0,
    ops: dict[tuple, Op] | None = None,
    ring: dict[str, Any] | None = None,
) -> RankTime:
    """The step of one rank (a pipeline rank: its work outside its actions; `ops`: the count whose operators its
    collectives' `before` names, if not this one's; `ring`: context parallelism's sends, timed by ring_time instead
    of as counted). What overlaps: on a machine whose collectives run beside compute (a GPU's own stream), DDP's and
    FSDP's, in forward and backward; not TP's (the next operator waits on them, `Collective.functional`), nor the
    numbers logged after backward."""
    threads = profile.threads(procs_per_node)
    compute_at = profile.for_threads(threads)
    share = _share(profile, procs_per_node, threads)
    compute: dict[str, float] = {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}
    overhead = 0.0
    for op in count.ops.values():
        work, more = compute_at.op_parts(op)
        compute[op.phase] += op.calls * (work + more) * share
        overhead += op.calls * more
    for (phase, _), calls in count.dtensor_calls.items():  # (a pipeline's are in its actions' cost)
        compute[phase] += calls * compute_at.dtensor_overhead_s * share
        overhead += calls * compute_at.dtensor_overhead_s
    for phase in ("forward", "backward"):  # an FSDP unit's hooks: half of them in each
        compute[phase] += count.fsdp_units * compute_at.unit_overhead_s / 2 * share
    compute["optimizer"] += compute_at.step_overhead_s * share  # (a pipeline rank's too: once, outside its actions)
    overhead += count.fsdp_units * compute_at.unit_overhead_s + compute_at.step_overhead_s
    comm = {phase: 0.0 for phase in compute}
    beside = {phase: 0.0 for phase in compute}
    chunks = {phase: 0 for phase in compute}
    for c in count.collectives:
        if ring and c.kind in ("send", "recv"):  # the ring's: by ring_time below
            continue
        seconds = profile.collective_time(c, _compute_before(c, count.ops if ops is None else ops, compute_at, share))
        comm[c.phase] += seconds
        if profile.overlap and not c.functional and c.phase != "optimizer" and c.kind not in ("send", "recv"):
            beside[c.phase] += seconds
            chunks[c.phase] += 1
    total = {p: _phase_time(compute[p], beside[p], comm[p] - beside[p], chunks[p]) for p in compute}
    if ring:
        attention = {p: 0.0 for p in compute}
        for op in (op for op in count.ops.values() if "scaled_dot_product" in op.name):
            attention[op.phase] += op.calls * sum(compute_at.op_parts(op)) * share
        for phase, (seconds, hidden) in ring_time(ring, profile, attention).items():
            comm[phase] += seconds
            total[phase] += seconds - hidden
    exposed = {p: total[p] - compute[p] for p in compute}
    sharing = sum(compute.values()) * (1 - 1 / share)
    return RankTime(rank, compute, comm, exposed, sum(total.values()), 0.0, overhead, sharing)


def ring_time(ring: dict[str, Any], profile: Profile, attention: dict[str, float]) -> dict[str, tuple[float, float]]:
    """{phase: (seconds, of them hidden)} of context parallelism's ring (`ring`: planner/predict.ring_traffic's
    sends and their bytes, and "cp"), each send over the ring's slowest link (the network once the ring leaves a
    node). What hides: on a GPU (the sends on their own stream) a key/value chunk travels while the chunk before it
    is computed (common/ring_attention.py starts it first), so the kv sends hide behind cp - 1 of the cp blocks of
    each attention (`attention`: its kernels' seconds by phase), the rest of the step's compute not; the gradient
    accumulator's sends are timed exposed, an upper bound (the ring waits for each only when the next rank adds its
    share, so all but the last travel beside a block). The link is the ring's alone (not shared with FSDP's
    collectives, which overlap as rank_time says). On a CPU nothing hides."""
    cp = ring["cp"]
    spans = profile.kind == "gpu" and cp > profile.devices_per_node
    where = (profile.devices_per_node - 1, 1) if spans else (0, 1)  # (a pair across two nodes, or within one)
    found = {}
    for phase in ("forward", "backward", "optimizer"):
        sends = ring.get(phase)
        if not sends:
            found[phase] = (0.0, 0.0)
            continue
        one = {
            k: profile.collective_time(Collective("send", 2, sends[f"{k}_bytes"], phase, first_and_stride=where))
            for k in ("kv", "dkv")
        }
        kv, dkv = sends["kv_sends"] * one["kv"], sends["dkv_sends"] * one["dkv"]
        hidden = min(kv, attention[phase] * (cp - 1) / cp) if profile.overlap else 0.0
        found[phase] = (kv + dkv, hidden)
    return found


def simulate_sharing(
    orders: list[list[tuple[int, str, int]]], cost: Any, *, cores: float, threads: int, transfer: Any = None
) -> tuple[float, list[float]]:
    """common/pipeline_actions.simulate on ranks that share `cores`: while k ranks of `threads` threads are busy,
    each advances at min(1, cores / (k x threads)) of its own speed (a rank waiting for its neighbour leaves its
    core to the others); what an action sends arrives `transfer(stage, kind)` seconds after it ends. (the makespan,
    each rank's busy seconds)."""
    from common.pipeline_actions import action_graph

    keys, inputs = action_graph(orders)
    finished: dict[tuple, float] = {}
    position, left, busy = [0] * len(orders), [None] * len(orders), [0.0] * len(orders)  # left: work of the running
    now, arriving = 0.0, []  # arriving: when what was sent, and is not there yet, arrives
    while True:
        for rank, order in enumerate(orders):  # start what can start
            if left[rank] is None and position[rank] < len(order):
                key = keys[rank][position[rank]]
                if all(finished.get(k, math.inf) <= now for k in inputs(key)):
                    left[rank] = cost(*order[position[rank]][:2])
        running = [r for r in range(len(orders)) if left[r] is not None]
        arriving = [t for t in arriving if t > now]
        if not running and arriving:
            now = min(arriving)
            continue
        if not running:
            if any(position[r] < len(order) for r, order in enumerate(orders)):
                raise RuntimeError("the recorded action orders depend on each other in a cycle")
            return now, busy
        speed = min(1.0, cores / (len(running) * threads))
        dt = min([left[r] / speed for r in running] + [t - now for t in arriving])  # type: ignore[operator]
        now += dt
        for r in running:
            busy[r] += dt
            left[r] -= dt * speed  # type: ignore[operator]
            if left[r] <= 1e-9 * (1 + now):  # type: ignore[operator]  (what rounding leaves of the shortest)
                sent = transfer(*orders[r][position[r]][:2]) if transfer else 0.0
                finished[keys[r][position[r]]] = now + sent
                arriving += [now + sent] if sent else []
                position[r], left[r] = position[r] + 1, None


def pipeline_time(
    counts: list[StepCount], profile: Profile, *, procs_per_node: int, ranks: list[int]
) -> tuple[float, float, list[RankTime]]:
    """(step seconds, bubble share, per rank) of the pipeline ranks `ranks` of one replica, whose `counts` hold the
    order of their actions: each action costs its operators and its collectives (TP's inside a stage, FSDP's over
    the replicas), and the activation or gradient it sends arrives that much later at the action that needs it; the
    actions are simulated together, and each rank's work outside them (the optimizer, the logged numbers) is added
    to the makespan."""
    from common.pipeline_actions import simulate

    if not all(count.actions for count in counts):
        raise RuntimeError("a pipeline rank's count holds no stage actions: its schedule's stages were not labelled")
    threads = profile.threads(procs_per_node)
    compute_at = profile.for_threads(threads)
    share = _share(profile, procs_per_node, threads)
    cost: dict[tuple[int, str], float] = {}
    sent: dict[tuple[int, str], float] = {}  # (stage, kind): seconds of what its runs send, on the receiver's path
    runs: dict[tuple[int, str], int] = {}
    outside, inside = [], []
    for count in counts:
        for stage, kind, _ in count.actions:
            runs[stage, kind] = runs.get((stage, kind), 0) + 1
        rest = StepCount(collectives=[c for c in count.collectives if not c.action])
        mine = {"forward": 0.0, "backward": 0.0, "overhead": 0.0, "communication": 0.0, "sent": 0.0}  # its actions
        for op in count.ops.values():
            work, more = compute_at.op_parts(op)
            if op.action:
                key = (int(op.action[:-1]), op.action[-1])
                cost[key] = cost.get(key, 0.0) + op.calls * (work + more)
                mine[op.phase] += op.calls * (work + more)
                mine["overhead"] += op.calls * more
            else:  # (its share of the cores: rank_time's)
                rest.ops[op.name, op.phase, id(op)] = op
        for (phase, action), calls in count.dtensor_calls.items():
            seconds = calls * compute_at.dtensor_overhead_s
            if action:
                key = (int(action[:-1]), action[-1])
                cost[key] = cost.get(key, 0.0) + seconds
                mine[phase] += seconds
                mine["overhead"] += seconds
            else:
                rest.dtensor_calls[phase, action] += calls
        for c in (c for c in count.collectives if c.action):
            key = (int(c.action[:-1]), c.action[-1])
            seconds = profile.collective_time(c, _compute_before(c, count.ops, compute_at, share))
            if c.kind == "send":  # (the sender goes on: the receiving action starts that much later)
                sent[key] = sent.get(key, 0.0) + seconds
                mine["sent"] += seconds
            else:
                cost[key] = cost.get(key, 0.0) + seconds
                mine["communication"] += seconds
        outside.append(rest)
        inside.append(mine)
    orders = [count.actions for count in counts]

    def per_run(totals: dict[tuple[int, str], float]) -> Any:
        """(stage, kind) -> the seconds of one run of that action, from the totals over its runs."""
        return lambda stage, kind: (
            totals.get((stage, kind), 0.0) / runs[stage, kind] if runs.get((stage, kind)) else 0.0
        )

    action_cost, transfer = per_run(cost), per_run(sent)
    if profile.kind == "cpu":  # the ranks share the cores as they are busy, not all the time
        copies = max(1, procs_per_node // len(orders))  # the other replicas' (and TP ranks') same actions, alongside
        makespan, busy = simulate_sharing(
            orders, action_cost, cores=profile.cores, threads=threads * copies, transfer=transfer
        )
    else:
        makespan, busy = simulate(orders, action_cost, transfer)
    times = [
        rank_time(rest, profile, procs_per_node=procs_per_node, rank=r, ops=count.ops)
        for r, rest, count in zip(ranks, outside, counts)
    ]
    bubble = 1 - sum(busy) / (len(orders) * makespan) if makespan else 0.0
    for r, busy_s, mine in zip(times, busy, inside):
        alone = mine["forward"] + mine["backward"] + mine["communication"]  # had its actions the cores to themselves
        r.bubble_s = makespan - busy_s
        r.sharing_s += max(0.0, busy_s - alone)
        r.overhead_s += mine["overhead"]
        r.communication["forward"] += mine["communication"] + mine["sent"]
        r.exposed["forward"] += mine["communication"]  # (on its rank's path; a wait for what was sent is bubble)
        r.step_s += makespan
        for phase in ("forward", "backward"):
            r.compute[phase] += mine[phase]
    return max(r.step_s for r in times), bubble, times


@dataclass
class StepTime:
    """A strategy's step at one world size, predicted: seconds, samples/s, MFU, and where the time goes (the
    slowest rank's compute, communication and what of it is exposed; a pipeline's bubble share)."""

    step_s: float
    samples_per_s: float
    mfu: float
    compute_s: float
    communication_s: float
    exposed_s: float
    bubble: float
    ranks: list[RankTime]
    overhead_s: float = 0.0
    sharing_s: float = 0.0
    bubble_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        fields = ("step_s", "samples_per_s", "mfu", "compute_s", "communication_s", "exposed_s", "bubble")
        fields += ("overhead_s", "sharing_s", "bubble_s")
        return {**{f: getattr(self, f) for f in fields}, "ranks": [r.__dict__ for r in self.ranks]}


def predict(cfg: Any, world_size: int, counts: dict[int, StepCount], profile: Profile) -> StepTime:
    """The step of `cfg` on `world_size` ranks from the counted steps of its planned ranks ({rank: count}):
    the slowest rank's, or a pipeline replica's simulated schedule."""
    from common.pipeline_layout import PipelineLayout
    from planner.predict import model_flops_per_step

    per_node = min(world_size, profile.devices_per_node) if profile.kind == "gpu" else world_size
    bubble = 0.0
    if cfg.strategy == "pippy":
        pp_ranks = [i * cfg.tp for i in range(PipelineLayout.of(cfg, world_size).pp_size)]  # replica 0, TP rank 0
        step, bubble, ranks = pipeline_time(
            [counts[r] for r in pp_ranks], profile, procs_per_node=per_node, ranks=pp_ranks
        )
    else:
        ring = None
        if cfg.strategy == "cp":  # the ring's sends, timed as ring_time says
            from planner.predict import ring_traffic

            ring = {**ring_traffic(cfg, world_size), "cp": world_size // cfg.dp}
        ranks = [rank_time(count, profile, procs_per_node=per_node, rank=r, ring=ring) for r, count in counts.items()]
        step = max(r.step_s for r in ranks)
    slowest = max(ranks, key=lambda r: r.step_s)
    model = model_flops_per_step(cfg)
    devices = world_size if profile.kind == "gpu" else 1  # a CPU profile's peak is the whole machine's
    return StepTime(
        step_s=step,
        samples_per_s=cfg.batch_size / step if step else math.nan,
        mfu=model / (step * devices * profile.peak(cfg.precision)) if step else math.nan,
        compute_s=sum(slowest.compute.values()),
        communication_s=sum(slowest.communication.values()),
        exposed_s=sum(slowest.exposed.values()),
        bubble=bubble,
        ranks=ranks,
        overhead_s=slowest.overhead_s,
        sharing_s=slowest.sharing_s,
        bubble_s=slowest.bubble_s,
    )
