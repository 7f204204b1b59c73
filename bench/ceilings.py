"""The ceilings a run is measured against (docs/performance.md): the machine's matmul peak, BabyCNN's training
FLOPs per sample (common/model_sizes.py) and the fastest a pipeline can train when its heaviest stage has one core."""

import math
import time
from typing import Any, Callable, Sequence

from bench.launches import CORES


def matmul_peak_gflops(dtype: str, threads: int, *, n: int, repeats: int, clock: Callable[[], float]) -> float:
    """Best-of-`repeats` GFLOP/s of an n x n x n matmul in `dtype` on `threads` CPU threads (torch keeps them). With
    one thread, clock=time.process_time measures the core's own work, whatever else shares the machine."""
    import torch

    torch.set_num_threads(threads)
    a, b = (torch.randn(n, n).to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]) for _ in "ab")
    for _ in range(2):
        a @ b
    best = math.inf
    for _ in range(repeats):
        started = clock()
        a @ b
        best = min(best, clock() - started)
    return 2 * n**3 / best / 1e9


def machine_peaks(*, n: int, repeats: int) -> dict[str, dict[str, float]]:
    """The matmul peak in fp32 and bf16 on 1 and all cores (wall clock) and on 1 by CPU time; `peak_gflops`: all."""
    threads, dtypes = lambda t: f"{t} thread{'s' if t > 1 else ''}", ("fp32", "bf16")
    peak = lambda d, t, clock=time.perf_counter: matmul_peak_gflops(d, t, n=n, repeats=repeats, clock=clock)
    by_threads = {f"{d} {threads(t)}": peak(d, t) for d in dtypes for t in sorted({1, CORES})}
    by_threads |= {f"{d} 1 thread, CPU time": peak(d, 1, time.process_time) for d in dtypes}
    all_cores = {d: by_threads[f"{d} {threads(CORES)}"] for d in dtypes}
    return {"peak_by_threads_gflops": by_threads, "peak_gflops": all_cores}


def model_flops(size: str = "baby", dataset: str = "digits") -> dict[str, Any]:
    """Training FLOPs per sample of the layers that have any: backward is twice forward (the gradients of the
    input and of the weights) but for the first layer, whose input (the images) needs no gradient."""
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
    """Per number of stages, the fastest a pipeline trains with one thread per rank: its heaviest stage (the scripts'
    cut) at the 1-thread matmul peak, layers without FLOPs free (an upper bound). r replicas on r cores: r times."""
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
