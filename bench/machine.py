"""This machine's profile for the planner's time model (planner/timing.py), measured: every distinct operator of the
steps the planner counts, timed out of the caches at each thread count the runners give a process; the first touch of
new pages; what a step, a DTensor call and an FSDP unit cost beyond their operators (bench/fits.py fits them); the
collectives (`bench.collectives --after-compute`) at each group size; the matmul peak. docs/time.md says how.

    python -m bench.machine                       # runs/machine/profile.json (~16 min on 2 cores)
    python -m planner --model-size small --profile runs/machine/profile.json
"""

from __future__ import annotations

import itertools
import json
import math
import queue
import statistics
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Sequence

from bench.fits import fit, split_overhead, wrapped_overheads
from bench.launches import CORES, ROOT, Parser, cpu_name, launch_env, numbers, torchrun

# The steps whose operators are timed: the models, strategies and process counts the time model is checked on with
# (bench.scale: every shape of operator those runs call, a rank's share of the batch, a pipeline's micro-batches...)
MODELS = ({}, {"model_size": "small"}, {"model": "vit"})
STRATEGIES = {"ddp": {}, "fsdp": {"shard_units": "blocks"}, "tp": {}, "pippy": {"n_microbatches": 4}}
WORLDS = (1, 2, 4)
OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send_recv")
MIN_TIMED_S, MIN_REPEATS = 0.05, 5
COLD_BYTES = 64 << 20  # the inputs an operator is timed on rotate over this much: twice these EPYCs' L3 (32 MiB)
PER_CALL = ("step_overhead_s", "op_overhead_s", "dtensor_overhead_s", "unit_overhead_s")  # Python's, measured
EAGER = ({}, {"model_size": "small"}, {"model": "vit"}, {"model": "vit", "model_size": "small"})  # sizes: the fit
WRAPPED = ({}, {"model": "vit"})  # under TP and FSDP; each one of EAGER, the step it is set against
SOURCES = {  # what profile.json says of each of its parts
    "compute": "python -m bench.machine: the suite's models' operators, timed here (bench/machine.py)",
    "collectives": "python -m bench.collectives at each group size, 1 KiB to 64 MiB",
    "collective_after_compute_s": "python -m bench.collectives --after-compute: 512 KiB after 1 to 24 ms of "
    "compute, [compute s, extra s]",
    "peak_flops": "a 2048^3 matmul on all cores, fp32 and bf16 (bench/benchmark.py)",
    "overlap": "gloo reduces on the cores that compute: nothing hides (docs/time.md)",
}


def counted_ops(quick: bool = False) -> dict[str, Any]:
    """{operator_key: Op}: every distinct kind of operator call of the steps, with the times it runs in them
    (calls), planned on every rank that runs different ones (planner/plan.py: ranks_to_measure)."""
    from dataclasses import replace

    from common.config import Config
    from planner.plan import counted_steps
    from planner.timing import operator_key
    from runner.layout import would_start

    found: dict[str, Any] = {}
    runs = itertools.product(MODELS[:1] if quick else MODELS, STRATEGIES.items(), (1, 2) if quick else WORLDS)
    for flags, (strategy, own), world in runs:
        cfg = replace(Config(strategy=strategy, **flags, **own), train_size=4096)
        for count in counted_steps(cfg, world).values() if would_start(cfg, world) else ():
            for op in count.ops.values():
                if (key := operator_key(op)) in found:
                    found[key].calls += op.calls
                else:
                    found[key] = op
    return found


def cold_inputs(op: Any, spread: int = COLD_BYTES) -> list[tuple[Any, Any]]:
    """Copies of `op`'s (args, kwargs) on real tensors (random floats, zero indices), as many as span `spread` bytes
    (2 to 256): timed in turn, each call reads inputs last touched `spread` bytes ago, out of the caches, as in a step,
    where an operator reads what others wrote before it."""
    import torch
    from torch.utils._pytree import tree_flatten, tree_map_only

    from planner.count import TensorSpec

    def real(spec: TensorSpec) -> torch.Tensor:
        tensor = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype)
        return tensor.normal_() if tensor.is_floating_point() else tensor.zero_()

    _, args, kwargs = op.call
    specs = [leaf for leaf in tree_flatten((args, kwargs))[0] if isinstance(leaf, TensorSpec)]
    one = sum(math.prod(spec.shape) * spec.dtype.itemsize for spec in specs)
    copies = min(256, max(2, math.ceil(spread / max(one, 1))))
    return [tree_map_only(TensorSpec, real, (args, kwargs)) for _ in range(copies)]


def time_op(op: Any) -> float | None:
    """Median seconds of one call of `op` on its `cold_inputs`, each copy in turn, or None where it cannot run
    outside its step (FSDP's storage resizes, a view of a freed buffer)."""
    func = op.call[0]
    try:
        inputs = cold_inputs(op)
        func(*inputs[0][0], **inputs[0][1])
        times, started = [], time.perf_counter()
        while len(times) < max(MIN_REPEATS, len(inputs)) or time.perf_counter() - started < MIN_TIMED_S:
            args, kwargs = inputs[len(times) % len(inputs)]
            times.append(_timed(func, *args, **kwargs))
    except Exception:  # noqa: BLE001  (an operator that needs its step's state: left out, counted below)
        return None
    return statistics.median(times)


def fresh_bytes_per_s(nbytes: int = 64 << 20) -> float:
    """How fast the OS gives this process pages it has not touched: a fill of `nbytes` on new pages (over
    MMAP_THRESHOLD, as the runs' allocator maps them afresh) against one into a buffer kept."""
    import torch

    from common.distributed import keep_freed_memory
    from planner.count import MMAP_THRESHOLD

    assert nbytes >= MMAP_THRESHOLD
    keep_freed_memory()
    kept = torch.empty(nbytes // 4)

    def fill(buffer: Any = None) -> float:  # a new buffer's seconds, or `buffer`'s
        return _timed(lambda: (torch.empty(nbytes // 4) if buffer is None else buffer).fill_(1.0))

    fresh, reused = zip(*[(fill(), fill(kept)) for _ in range(MIN_REPEATS * 2)])  # (side by side: the speed drifts)
    return nbytes / max(statistics.median(fresh) - statistics.median(reused), 1e-9)


def keep_every_page() -> bool:
    """From here on this process maps no buffer afresh (glibc: no mmap, no trim), so an operator timed again and
    again times its work, not its first touch of new pages: the planner adds that apart (Op.fresh_bytes). False
    where mallopt is not available: nothing changes."""
    import ctypes

    from common.distributed import keep_freed_memory

    m_mmap_max = -4  # glibc's malloc.h
    return keep_freed_memory() and bool(ctypes.CDLL("libc.so.6").mallopt(m_mmap_max, 0))


def _wrapped_steps() -> list[tuple[int, Any, Any]]:
    """(its model's index in EAGER, a step function, its count) of each model of WRAPPED under TP and FSDP (a unit per
    block) on a world of one process, as train_tp.py and train_fsdp.py wrap them: what DTensor's calls and FSDP's
    units cost besides their operators. A gloo group of this process alone (forked measuring processes: one each)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from common.config import Config
    from planner.measure import _model
    from train_fsdp import apply_fsdp, fsdp_mesh
    from train_tp import apply_tp

    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    steps = []
    for flags in WRAPPED:
        cfg = Config(**flags)
        tp = init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))["tp"]
        plain = _model(cfg)
        for model in (
            apply_tp(plain, tp, plain.tp_plan(False)),
            apply_fsdp((fsdp := _model(cfg)), fsdp_mesh("cpu", 1), units=fsdp.blocks()),
        ):
            steps.append((EAGER.index(flags), *_counted_step(cfg, model)))
    return steps


def _counted_step(cfg: Any, model: Any) -> tuple[Any, Any]:
    """(a training step of `model` as the scripts run it, on 2 samples: where the work is small, what a step costs
    besides its operators shows; and its count): three steps first, so the count sees a warm step."""
    import torch.nn.functional as F

    from common.training import build_optimizer
    from planner.count import StepCounter
    from planner.measure import _batch

    optimizer = build_optimizer(model.parameters(), cfg)
    for group in optimizer.param_groups:  # the same work at lr 0, the weights kept where they start: trained over
        group["lr"] = 0.0  # and over on 2 samples, the gradients fall to subnormal floats (x75 a convolution on Intel)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        images, labels = _batch(cfg, 2)
        F.cross_entropy(model(images), labels).backward()
        optimizer.step()

    for _ in range(3):
        step()
    with StepCounter(model) as counter:
        step()
    return step, counter.count


def _timed(call: Any, *args: Any, **kwargs: Any) -> float:
    started = time.perf_counter()
    call(*args, **kwargs)
    return time.perf_counter() - started


def beyond_operators(step: Any, ops: Any) -> tuple[float, int]:
    """(seconds, kernel calls): what a step spends beyond its operators' own time, timed alone between two timings
    of the step (the machine's speed drifts), and the calls the per-call cost is charged to (planner/timing.py:
    pays_call_cost)."""
    from planner.timing import pays_call_cost

    step_s = lambda: statistics.median(_timed(step) for _ in range(20))  # noqa: E731 (the median of 20 steps)
    before, alone = step_s(), sum(op.calls * (time_op(op) or 0.0) for op in ops.values())
    measured = (before + step_s()) / 2
    return measured - alone, sum(op.calls for op in ops.values() if pays_call_cost(op))


def processes_at(threads: int) -> int:
    """How many processes a run gives `threads` threads each (common/distributed.py: cores / local processes)."""
    return max(1, CORES // threads)


def _measure(threads: Sequence[int], quick: bool, together: Any, results: Any, index: int) -> None:
    """In one of the processes that together load the cores as the runners do: count the steps' operators, then time
    each at every thread count in turn (side by side, not minutes apart) in as many processes at once as runners with
    that many threads a process start (`index` below cores / threads: the others wait); fit each table, time the
    eager steps for the overheads, and put (index, {threads: fit}) in `results`."""
    import torch

    from common.config import Config
    from planner.measure import _model
    from planner.timing import op_class, operator_key

    ops = counted_ops(quick)
    eager = [_counted_step(Config(**flags), _model(Config(**flags))) for flags in EAGER]  # (a step, its count) each
    wrapped = _wrapped_steps()
    for counted in [count.ops for _, count in eager] + [count.ops for _, _, count in wrapped]:
        for op in counted.values():
            ops.setdefault(operator_key(op), op)
    active = [t for t in threads if index < processes_at(t)]

    def at_each(measure: Any, *args: Any) -> dict[int, Any]:  # {t: measure(*args)} on t threads, in step
        found = {}
        for t in threads:
            if t in active:
                torch.set_num_threads(t)
                found[t] = measure(*args)
            together.wait()
        return found

    together.wait()
    fresh = at_each(fresh_bytes_per_s)
    keep_every_page()
    seconds = {key: at_each(time_op, ops[key]) for key in sorted(ops)}  # (every process in the same order)
    skipped = sorted({ops[key].name for key, at in seconds.items() if None in at.values()})
    found = {}
    for t in active:
        timed = {key: at[t] for key, at in seconds.items() if at[t] is not None}
        found[t] = fit([(op_class(ops[k].name), ops[k].flops, ops[k].bytes, timed[k], ops[k].calls) for k in timed])
        found[t] |= {"operators": timed, "fresh_bytes_per_s": fresh[t], "alone_overhead_s": found[t]["op_overhead_s"]}
        found[t]["fit"]["not_timed"] = skipped  # (alone_overhead_s: what the rates add for an operator not timed)

    def overheads() -> dict[str, float]:  # what training steps pay beyond their operators
        plain = [beyond_operators(step, count.ops) for step, count in eager]
        costs = split_overhead(plain)
        timed = [(*beyond_operators(step, count.ops), count, plain[own]) for own, step, count in wrapped]
        return costs | wrapped_overheads(timed, costs["op_overhead_s"])

    for t, costs in at_each(overheads).items():
        found[t].update(costs)
    results.put((index, found))


def measure_compute(threads: Sequence[int], *, quick: bool = False) -> dict[int, dict[str, Any]]:
    """{threads: the fit} over the steps' operators, timed in as many processes at once as the runners start (they
    share memory bandwidth and caches: one process alone would time them faster than a run goes). Forked before this
    process has run autograd or OpenMP (neither survives a fork)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    copies = max(map(processes_at, threads))
    together, results = context.Barrier(copies), context.Queue()
    workers = [context.Process(target=_measure, args=(threads, quick, together, results, i)) for i in range(copies)]
    for worker in workers:
        worker.start()
    fits: dict[int, dict[int, Any]] = {}
    while len(fits) < copies:  # a worker that dies (out of memory, a signal) says so instead of hanging here
        try:
            fits.update([results.get(timeout=10)])
        except queue.Empty:
            if dead := [w.exitcode for w in workers if w.exitcode not in (None, 0)]:
                together.abort()  # (the others wait for it at their next meeting: they end too)
                raise RuntimeError(f"a measuring process ended with exit code {dead[0]}") from None
    for worker in workers:
        worker.join()
    found = {t: fits[0][t] for t in threads}  # (the others ran alongside it)
    for cost in PER_CALL:
        # the interpreter's costs, the same at any thread count: one measurement moves by 2x on a busy VM, so every
        # process's at every thread count, averaged (the mean at each thread count stays in "fit")
        for t, fit_t in found.items():
            fit_t[cost] = statistics.fmean(fits[i][t][cost] for i in fits if t in fits[i])
            fit_t["fit"][f"measured_{cost}"] = fit_t[cost]
        mean = statistics.fmean(fit_t[cost] for fit_t in found.values())
        for fit_t in found.values():
            fit_t[cost] = mean
    for t, fit_t in found.items():
        summary = {k: v for k, v in fit_t.items() if k not in ("operators", "fit")}
        print(f"compute on {t} thread(s) a process: {summary}", file=sys.stderr, flush=True)
    return found


def measure_collectives(n: int, out: Path, *, quick: bool) -> dict[str, Any]:
    """bench.collectives' report on `n` processes (its rows, and an all-reduce after compute), launched as a user
    would (torchrun), on the CPU even where there are GPUs: the profile is of this machine's cores and their gloo."""
    flags = ["--min-bytes", "1K", "--max-bytes", "1M" if quick else "64M", "--after-compute", "--ops", ",".join(OPS)]
    command = [*torchrun(n), "-m", "bench.collectives", "--out", str(out / f"collectives-{n}"), *flags]
    cpu_only = launch_env(n, CUDA_VISIBLE_DEVICES="")  # setup_distributed then picks gloo on the CPU
    subprocess.run(command, cwd=ROOT, env=cpu_only, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / f"collectives-{n}" / "collectives.json").read_text())


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser("python -m bench.machine", __doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/machine", help="folder for profile.json")
    parser.add_argument("--procs", default="1,2,4", help="the process counts the runs will use (threads, groups)")
    parser.add_argument("--quick", action="store_true", help="BabyCNN's operators, collectives to 1 MiB: a smoke test")
    args = parser.parse(argv)
    procs = sorted(set(numbers("--procs", args.procs)))
    import torch

    from bench.benchmark import matmul_peak_gflops

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    threads = sorted({max(1, CORES // n) for n in procs})
    compute = measure_compute(threads, quick=args.quick)
    side = 1024 if args.quick else 2048  # all cores' dense matmul peak by dtype: what MFU is against
    peak = {dtype: 1e9 * matmul_peak_gflops(dtype, CORES, n=side, repeats=3) for dtype in ("fp32", "bf16")}
    collectives = {n: measure_collectives(n, out, quick=args.quick) for n in procs if n > 1}
    profile = {"name": f"{cpu_name()}, {CORES} cores (measured {date.today()})", "kind": "cpu", "cores": CORES}
    profile |= {"peak_flops": peak, "compute": {str(t): c for t, c in compute.items()}}
    profile["collectives"] = {str(n): report["results"] for n, report in collectives.items()}
    profile["collective_after_compute_s"] = {str(n): r["after_compute"]["curve"] for n, r in collectives.items()}
    profile |= {"overlap": False, "sources": SOURCES}
    command = " ".join(["python -m bench.machine", *(argv or sys.argv[1:])])
    profile["measured"] = {"command": command, "torch": torch.__version__}
    path = out / "profile.json"
    path.write_text(json.dumps(profile, indent=1))
    print(f"profile: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
