"""Collective communication measured in nccl-tests' terms: time, algbw and busbw per op and message size.

    torchrun --standalone --nproc-per-node 4 -m bench.collectives           # 4 KiB .. 256 MiB: runs/collectives/
    torchrun --standalone --nproc-per-node 4 -m bench.collectives --quick   # 3 sizes, a smoke test in seconds
    torchrun --standalone --nproc-per-node 2 -m bench.collectives --after-compute  # + an all-reduce as a step calls it
    NPROC=3 python -m bench.collectives --ops all_reduce,all_reduce_ring    # checks the flags, then starts torchrun

docs/communication.md says what each op, size and bandwidth is. Each op is checked on known values, then timed
per size (time_op); rank 0 prints the table and writes collectives.json and collectives.png in --out.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from bench.launches import CORES, ROOT, LoadWatch, Parser, cpu_name, cpu_seconds, peak_rss_bytes, torchrun
from common.errors import UserError
from runner.entry import fail

if TYPE_CHECKING:
    import torch

    from common.distributed import DistEnv

OPS = ("all_reduce", "all_reduce_ring", "reduce_scatter", "all_gather", "broadcast", "send_recv")
FLOAT32 = 4  # bytes per element
TARGET_S, QUICK_TARGET_S = 0.25, 0.02  # timed seconds per op and size: 250 calls of 1 ms, 3 (MIN_ITERS) of 0.5 s
MIN_ITERS, MAX_ITERS = 3, 1000  # nccl-tests times 20 by default; here small messages vary from call to call, so more
WARMUP_ITERS, WARMUP_S = 5, 0.05  # nccl-tests' default -w 5, fewer where that would take longer than WARMUP_S
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
TIMING = "per op: the slowest rank's mean over back-to-back calls (nccl-tests -a 3)"
# --after-compute: an all-reduce of TP's size in the ViT (512 KiB) after each compute time of AFTER_CURVE_S: what a
# step computes between two collectives, from a fraction of a millisecond (FSDP's units) to a whole backward (DDP's
# one bucket); `extra_s` after 8 ms (the ViT under TP: 6 ms); rounds interleaved, the median kept
AFTER_COMPUTE_S, AFTER_BYTES, AFTER_ROUNDS, AFTER_TARGET_S = 0.008, 512 << 10, 5, 0.5
AFTER_CURVE_S, QUICK_CURVE_S = (0.001, 0.003, 0.008, 0.024), (0.002, 0.008)
RUNTIME_MIB = 600  # a CPU worker's peak RSS besides its messages: 526 MiB measured with 1 MiB messages (torch, gloo)


def human(nbytes: float) -> str:
    """4096 -> '4 KiB', 268435456 -> '256 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' busbw / algbw on n ranks: the share of the size each rank sends (docs/communication.md)."""
    share = (n - 1) / n  # an all-reduce is a reduce-scatter then an all-gather
    return 2 * share if op.startswith("all_reduce") else share if op in ("reduce_scatter", "all_gather") else 1.0


def parse_bytes(flag: str, text: str) -> int:
    """'4096', '4K', '256M', '1G' (powers of 1024, as nccl-tests reads -b and -e) -> bytes."""
    number, unit = (text[:-1], text[-1].upper()) if text[-1:].upper() in UNITS else (text, "")
    value = int(number) * UNITS[unit] if number.isdigit() else 0
    if value <= 0:
        raise UserError(f"{flag}: {text!r} is not a positive size; give bytes, e.g. 4096, 64K or 256M")
    return value


def parse_args(argv: Sequence[str], world_size: int) -> argparse.Namespace:
    """The flags, checked for a run of `world_size` processes: a bad one raises UserError (one line)."""
    prog = "torchrun --standalone --nproc-per-node 4 -m bench.collectives"
    parser = Parser(prog, __doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--out", default="runs/collectives", help="folder for collectives.json and .png")
    add("--min-bytes", default="4096", help="smallest message (bytes; K, M, G: powers of 1024)")
    add("--max-bytes", default="268435456", help="largest message (bytes; K, M, G)")
    add("--ops", default=",".join(OPS), help="which ops, comma-separated")
    add("--quick", action="store_true", help="every 16th size up to 1 MiB, briefly: a smoke test")
    add("--after-compute", action="store_true", help="also what an all-reduce costs after compute, beyond the table")
    args = parser.parse_args(argv)
    args.min_bytes = parse_bytes("--min-bytes", args.min_bytes)
    args.max_bytes = parse_bytes("--max-bytes", args.max_bytes)
    args.ops = args.ops.split(",")
    if args.min_bytes > args.max_bytes:
        raise UserError(f"--min-bytes: {args.min_bytes} is larger than --max-bytes {args.max_bytes}; swap them")
    if args.min_bytes < FLOAT32 * world_size:  # all_gather and reduce_scatter need one float32 per rank
        raise UserError(
            f"--min-bytes: {args.min_bytes} bytes hold less than one float32 per rank for {world_size} processes; "
            f"use at least {FLOAT32 * world_size}"
        )
    if unknown := [op for op in args.ops if op not in OPS]:
        raise UserError(f"--ops: unknown op {unknown[0]!r}; choose from {','.join(OPS)}")
    if world_size < 2:
        raise UserError(f"--nproc-per-node (NPROC): a collective needs at least 2 processes, not {world_size}")
    return args


def check_memory(max_bytes: int, processes: int) -> None:
    """The memory wall on the CPU: a process holds up to ~3 messages at once (all_gather: 2.2 x 256 MiB measured)."""
    from runner.memory import available_mib

    available, need = available_mib(), processes * (RUNTIME_MIB + 3 * max_bytes / 2**20)
    if available is not None and need > available:
        raise UserError(
            f"--max-bytes: {processes} processes x ({RUNTIME_MIB} MiB + 3 x {human(max_bytes)}) need ~{need / 1024:.1f}"
            f" GiB, {available / 1024:.1f} GiB are available; lower --max-bytes"
        )


def build_op(
    op: str, size: int, env: DistEnv, *, fill: bool = False
) -> tuple[Callable[[], object] | None, int, torch.Tensor]:
    """(one call of `op` at nccl-tests' `size`, the bytes that size really is, the tensor the result lands in).
    The call is None on a rank that sits out (send_recv on ranks past 1). The tensors hold zeros, which sum to
    zeros call after call (ones would overflow to inf); fill=True: rank r's hold r + 1, for `check_ops`."""
    import torch
    import torch.distributed as dist

    from common.ring import ring_all_reduce

    n, rank = env.world_size, env.rank
    tensor = lambda numel: torch.full((numel,), rank + 1.0 if fill else 0.0, dtype=torch.float32, device=env.device)
    sharded = op in ("reduce_scatter", "all_gather")
    numel = size // (FLOAT32 * n) * n if sharded else size // FLOAT32  # sharded: rounded down to n equal shards
    whole, shard = tensor(numel), tensor(numel // n) if sharded else None
    # torch 2.14 renamed reduce_scatter_tensor and all_gather_into_tensor (the old names warn); same calls
    reduce_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    all_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    calls = {  # send_recv: one pair, so that one link is all that is measured; the other ranks sit out
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_reduce_ring": lambda: ring_all_reduce(whole),
        "reduce_scatter": lambda: reduce_scatter(shard, whole),
        "all_gather": lambda: all_gather(whole, shard),
        "broadcast": lambda: dist.broadcast(whole, src=0),
        "send_recv": [lambda: dist.send(whole, dst=1), lambda: dist.recv(whole, src=0)][rank] if rank < 2 else None,
    }
    return calls[op], numel * FLOAT32, shard if op == "reduce_scatter" else whole


def check_ops(ops: Sequence[str], env: DistEnv) -> None:
    """Each op once on rank-numbered values (rank r holds r + 1) before anything is timed, at an odd size so that
    the ring's chunks are uneven: a wrong sum or a misplaced shard stops the run, as nccl-tests' check would."""
    import torch

    n = env.world_size
    for op in ops:
        call, _, output = build_op(op, FLOAT32 * (7 * n + 3), env, fill=True)
        if call is None:
            continue
        call()
        shards = torch.arange(1, n + 1, dtype=torch.float32, device=output.device)  # all_gather: shard k from rank k
        ones = op in ("broadcast", "send_recv")  # rank 0's ones; the reductions: the sum over the ranks
        full = torch.full_like(output, 1.0 if ones else n * (n + 1) / 2)
        expected = shards.repeat_interleave(output.numel() // n) if op == "all_gather" else full
        if not torch.equal(output, expected):
            got, want = output.tolist()[:8], expected.tolist()[:8]
            raise RuntimeError(f"[rank {env.rank}] {op} is wrong: got {got}.., expected {want}..")


def every_rank(value: float, env: DistEnv) -> list[float]:
    """`value` from every rank, on every rank: an all-reduce of a vector with one entry per rank."""
    import torch
    import torch.distributed as dist

    values = torch.zeros(env.world_size, dtype=torch.float64, device=env.device)
    values[env.rank] = value
    dist.all_reduce(values)
    return values.tolist()


def mean_s(call: Callable[[], object] | None, count: int, env: DistEnv) -> float:
    """This rank's mean seconds over `count` back-to-back calls, after a barrier has lined the ranks up (0.0 on a
    rank that sits out)."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    if call is None:
        return 0.0
    gpu = env.device.type == "cuda"  # the GPU's clock: a call returns once it is queued on the stream, not done
    start, end = (torch.cuda.Event(enable_timing=True) for _ in "se") if gpu else (None, None)
    started = start.record() if gpu else time.perf_counter()
    for _ in range(count):
        call()
    if gpu:
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / count
    return (time.perf_counter() - started) / count


def time_op(call: Callable[[], object] | None, env: DistEnv, *, target_s: float) -> tuple[list[float], int]:
    """(each rank's mean seconds per call, 0.0 on a rank that sits out; the calls timed, the same on every rank)."""

    def calls(count: int) -> None:
        for _ in range(count if call is not None else 0):
            call()

    calls(1)  # the first call sets up gloo's pairs or NCCL's communicator and touches the pages: not timed
    one = max(max(every_rank(mean_s(call, 1, env), env)), 1e-9)  # a second call, timed: how many fit in target_s
    calls(min(WARMUP_ITERS - 2, int(WARMUP_S / one)))  # the rest of the warm-up, if it is cheap
    iters = min(MAX_ITERS, max(MIN_ITERS, math.ceil(target_s / one)))
    return every_rank(mean_s(call, iters, env), env), iters


def time_after_compute(env: DistEnv, *, quick: bool) -> dict[str, Any]:
    """What an all-reduce costs a training step beyond the table's back-to-back time (docs/communication.md): the
    all-reduce of AFTER_BYTES after each compute time of AFTER_CURVE_S (matmuls), less the matmuls alone and the
    back-to-back all-reduce, the three in turn each round (the speed drifts), the slowest rank's, the median over
    rounds. `curve`: [compute seconds, extra seconds] at each."""
    import torch
    import torch.distributed as dist

    whole = torch.zeros(AFTER_BYTES // FLOAT32)
    a = torch.randn(128, 128)

    def slowest_s(matmul_count: int, reduce: bool, iters: int) -> float:
        """The slowest rank's mean seconds per call of `matmul_count` matmuls, then the all-reduce if `reduce`."""

        def call() -> None:
            for _ in range(matmul_count):
                a @ a
            if reduce:
                dist.all_reduce(whole)

        return max(every_rank(mean_s(call, iters, env), env))

    slowest_s(20, False, 1)  # warm-up
    matmul_s = slowest_s(1, False, 100)
    back_to_back = slowest_s(0, True, 10)
    target, rounds = (QUICK_TARGET_S, 1) if quick else (AFTER_TARGET_S, AFTER_ROUNDS)
    points = []
    for compute_s in QUICK_CURVE_S if quick else AFTER_CURVE_S:
        count = max(1, round(compute_s / matmul_s))
        iters = {True: max(MIN_ITERS, round(target / back_to_back)), False: max(MIN_ITERS, round(target / compute_s))}
        measured = [
            {"compute_s": slowest_s(count, False, iters[False]), "after_s": slowest_s(count, True, iters[False])}
            | {"back_to_back_s": slowest_s(0, True, iters[True])}
            for _ in range(rounds)
        ]
        extra = statistics.median(r["after_s"] - r["compute_s"] - r["back_to_back_s"] for r in measured)
        compute = statistics.median(r["compute_s"] for r in measured)
        points.append(dict(target_s=compute_s, matmuls=count, rounds=measured, compute_s=compute, extra_s=extra))
    at = next(p for p in points if p["target_s"] == AFTER_COMPUTE_S)
    curve = [[p["compute_s"], p["extra_s"]] for p in points]
    return dict(bytes=AFTER_BYTES, matmuls=at["matmuls"], rounds=at["rounds"], extra_s=at["extra_s"], curve=curve)


def measure(args: argparse.Namespace, env: DistEnv, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every op at every size, checked first; rank 0 logs the table as it goes."""
    import torch

    # every power of 2 times --min-bytes up to --max-bytes; --quick: every 16th, up to 1 MiB
    step, top = (16, max(args.min_bytes, min(args.max_bytes, 1 << 20))) if args.quick else (2, args.max_bytes)
    sizes = [args.min_bytes]
    while sizes[-1] * step <= top:
        sizes.append(sizes[-1] * step)
    check_ops(args.ops, env)
    where = f"{env.world_size} processes, {env.backend} on {env.device.type}, {cpu_name()}, torch {torch.__version__}"
    log(f"# {where}; {human(sizes[0])} .. {human(sizes[-1])}; time: the slowest rank's mean")
    log(f"{'op':<16} {'size (B)':>11} {'iters':>5} {'time (us)':>12} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    results = []
    for op in args.ops:
        for size in sizes:
            call, nbytes, _ = build_op(op, size, env)
            times, iters = time_op(call, env, target_s=QUICK_TARGET_S if args.quick else TARGET_S)
            del call  # frees this size's tensors before the next size allocates its own
            measured = times[1:2] if op == "send_recv" else times  # send_recv: the receiver's time
            time_s = max(measured)
            algbw = nbytes / time_s / 1e9
            busbw = algbw * bus_factor(op, env.world_size)
            results.append(dict(op=op, bytes=nbytes, time_s=time_s, algbw_GBps=algbw, busbw_GBps=busbw, iters=iters))
            results[-1]["time_s_per_rank"] = measured
            log(f"{op:<16} {nbytes:>11} {iters:>5} {time_s * 1e6:>12.1f} {algbw:>13.3f} {busbw:>13.3f}")
    return results


def draw(report: dict[str, Any], path: Path) -> None:
    """busbw against message size (log-x), a line per op, an op's colour whatever --ops measured."""
    from matplotlib.figure import Figure  # matplotlib only where a figure is drawn; no pyplot: no display

    fig = Figure(figsize=(6, 4.6))
    ax = fig.subplots()
    for i, op in enumerate(OPS):
        if rows := [r for r in report["results"] if r["op"] == op]:
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-", ms=3, color=f"C{i}", label=op)
    sizes = [r["bytes"] for r in report["results"]]
    ticks = [4**k for k in range(40) if 0.9 * min(sizes) <= 4**k <= 1.1 * max(sizes)]  # 4 KiB, 16 KiB, ..
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(ticks, [human(t) for t in ticks], fontsize=8)
    ax.grid(alpha=0.3)
    ax.set(xlabel="message size (nccl-tests' size)", ylabel="busbw (GB/s)")
    where = f"{report['world_size']} processes, {report['backend']} on {report['device']}; {report['machine']}"
    ax.set_title(f"{where}, torch {report['torch']}, {report['date']}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def worker(argv: list[str]) -> None:
    """One torchrun worker: join the group, check and time every op at every size, rank 0 reports."""
    import torch

    from common.distributed import RankLogger, setup_distributed, teardown_distributed

    args = parse_args(argv, int(os.environ["WORLD_SIZE"]))  # every rank checks: a bad flag stops them all at once
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size):  # setup_distributed's rule
        check_memory(args.max_bytes, local_world_size)  # on the CPU: every process on this machine in its memory
    env = setup_distributed()
    log = RankLogger(env.is_main)
    try:
        if args.after_compute and env.device.type != "cpu":  # (every rank: they stop together)
            raise UserError("--after-compute: times gloo on CPUs, whose cores compute and reduce; leave it out on GPUs")
        watch = LoadWatch()
        results = measure(args, env, log)
        after = time_after_compute(env, quick=args.quick) if args.after_compute else None
        if after:
            extra = ", ".join(f"{e * 1e3:+.2f} ms after {c * 1e3:.1f} ms" for c, e in after["curve"])
            log(f"# an all-reduce of {human(after['bytes'])} after compute: {extra} beyond the table's")
        wall_s = watch.elapsed_s()
        ranks_cpu_s = sum(every_rank(cpu_seconds()[1] - watch.cpu_before[1], env))  # every thread of every rank
        peak_rss = int(max(every_rank(peak_rss_bytes() or 0, env)))
        if not env.is_main:
            return
        other_cores = watch.other_cores(ranks_cpu_s)  # torchrun's agent included
        command = f"torchrun --standalone --nproc-per-node {env.local_world_size} -m bench.collectives"
        gpu = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else None
        report = dict(world_size=env.world_size, backend=env.backend, device=env.device.type, gpu=gpu)
        report |= dict(torch=torch.__version__, date=date.today().isoformat(), machine=cpu_name(), cores=CORES)
        report |= dict(command=" ".join([command, *argv]), timing=TIMING, wall_s=wall_s, load_before=watch.load_before)
        report |= dict(other_processes_cores=other_cores, peak_rss_bytes=peak_rss, results=results)
        report |= {"after_compute": after} if after else {}
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "collectives.json").write_text(json.dumps(report, indent=1) + "\n")
        draw(report, out / "collectives.png")
        log(f"# {wall_s:.1f} s; other processes kept {other_cores:.2f} of {CORES} cores busy meanwhile")
        log(f"wrote {out / 'collectives.json'}, {out / 'collectives.png'}")
    finally:
        teardown_distributed()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ:  # a torchrun worker
        from common.distributed import run

        run(lambda: worker(argv))  # a UserError: one line from rank 0, exit 2
        return
    # Without torchrun: the flags are checked here, so a bad one is one line and exit 2 (a worker's exit 2 would
    # become torchrun's exit 1 and its report); then this process becomes torchrun.
    from runner.memory import gpu_mib

    text = os.environ.get("NPROC", "4")
    try:
        if not text.isdigit():
            raise UserError(f"NPROC: {text!r} is not a process count")
        args, nproc = parse_args(argv, int(text)), int(text)
        if gpu_mib() is None:  # no NVIDIA GPU (nvidia-smi says): the workers will hold their messages in this memory
            check_memory(args.max_bytes, nproc)
    except UserError as e:
        fail(str(e))
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)  # finds bench from any folder
    os.execve(sys.executable, [*torchrun(nproc), "-m", "bench.collectives", *argv], {**os.environ, "PYTHONPATH": path})


if __name__ == "__main__":
    main()
