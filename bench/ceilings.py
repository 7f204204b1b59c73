"""The ceilings a run is measured against: the machine's matmul peak, BabyCNN's training FLOPs per sample (the
model's own count, common/model_sizes.py), and the fastest a pipeline can train when its heaviest stage has one
core."""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

from bench.machine import CORES


def matmul_peak_gflops(
    dtype_name: str, threads: int, *, n: int = 2048, repeats: int = 8, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n x n matmul in `dtype_name` on `threads` CPU threads. With one
    thread, clock=time.process_time measures the core's own work, whatever else shares the machine."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        for _ in range(2):
            a @ b
        best = math.inf
        for _ in range(repeats):
            started = clock()
            a @ b
            best = min(best, clock() - started)
        return 2 * n**3 / best / 1e9
    finally:
        torch.set_num_threads(previous)


def machine_peaks(*, n: int, repeats: int) -> dict[str, dict[str, float]]:
    """The matmul peak in fp32 and bf16 on 1 thread and on all cores (wall clock), and on 1 thread by CPU time.
    `peak_gflops` is the all-cores figure of each dtype: the one a run's "% of peak" is a fraction of."""
    threads, dtypes = lambda t: f"{t} thread{'s' if t > 1 else ''}", ("fp32", "bf16")
    peak = lambda d, t, clock=time.perf_counter: matmul_peak_gflops(d, t, n=n, repeats=repeats, clock=clock)
    by_threads = {f"{d} {threads(t)}": peak(d, t) for d in dtypes for t in sorted({1, CORES})}
    by_threads |= {f"{d} 1 thread, CPU time": peak(d, 1, time.process_time) for d in dtypes}
    return {
        "peak_by_threads_gflops": by_threads,
        "peak_gflops": {d: by_threads[f"{d} {threads(CORES)}"] for d in dtypes},
    }


def model_flops(size: str = "baby", dataset: str = "digits") -> dict[str, Any]:
    """Training FLOPs per sample of the layers that have any (convolutions and linear layers, 2 x multiply-adds:
    common/model_sizes.py). Backward is twice forward (the gradients of the input and of the weights), as
    stage_starts assumes, except for the first layer, whose input (the images) needs no gradient."""
    from common.model_sizes import layers

    counted = [layer for layer in layers(size, dataset) if layer.flops]
    rows = [
        {"layer": layer.name, "forward": layer.flops, "backward": layer.flops * (1 if i == 0 else 2)}
        for i, layer in enumerate(counted)
    ]
    return {"train_flops_per_sample": sum(r["forward"] + r["backward"] for r in rows), "layers": rows}


def pipeline_ceiling(
    layers: Sequence[dict[str, Any]], *, stage_counts: Sequence[int], peak_one_thread_gflops: float
) -> dict[str, dict[str, Any]]:
    """The fastest a pipeline can train here with one thread per rank, per number of stages: its heaviest stage
    (the scripts' own cut, stage_starts) runs on one core, at best at the 1-thread matmul peak, and every sample
    passes through it. `layers` are model_flops()'s; layers without FLOPs count as free, so this is an upper
    bound. With r pipeline replicas on r or more cores the bound is r times this."""
    from common.model_sizes import layers as model_layers
    from common.model_sizes import max_stages, stage_starts

    flops = {layer["layer"]: layer["forward"] + layer["backward"] for layer in layers}
    names = [layer.name for layer in model_layers("baby")]
    ceiling = {}
    for n in (n for n in stage_counts if 1 <= n <= max_stages("baby")):
        bounds = [names.index(start) for start in stage_starts("baby", n)] + [len(names)]
        stages = [names[a:b] for a, b in zip(bounds, bounds[1:])]
        heaviest = max(stages, key=lambda stage: sum(flops.get(name, 0) for name in stage))
        stage_flops = sum(flops.get(name, 0) for name in heaviest)
        speed = peak_one_thread_gflops * 1e9 / stage_flops
        ceiling[str(n)] = {"heaviest_stage": heaviest, "train_flops_per_sample": stage_flops, "samples_per_s": speed}
    return ceiling
