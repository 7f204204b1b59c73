"""The ceilings a run is measured against: the machine's matmul peak, BabyCNN's training FLOPs per sample
(counted from its layers' shapes), and the fastest a pipeline can train when its heaviest stage has one core."""

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
    by_threads = {
        f"{d} {t} thread{'s' if t > 1 else ''}": matmul_peak_gflops(d, t, n=n, repeats=repeats)
        for d in ("fp32", "bf16")
        for t in sorted({1, CORES})
    }
    for d in ("fp32", "bf16"):
        by_threads[f"{d} 1 thread, CPU time"] = matmul_peak_gflops(d, 1, n=n, repeats=repeats, clock=time.process_time)
    all_cores = f"{CORES} thread{'s' if CORES > 1 else ''}"
    return {
        "peak_by_threads_gflops": by_threads,
        "peak_gflops": {d: by_threads[f"{d} {all_cores}"] for d in ("fp32", "bf16")},
    }


def model_flops(*, in_channels: int = 1, image_size: int = 28, num_classes: int = 10) -> dict[str, Any]:
    """BabyCNN's training FLOPs per sample, counted from its layers' shapes.

    Forward: 2 x multiply-adds of every Conv2d and Linear (elementwise ops, LayerNorm and pooling are not
    counted: they are not matmuls). Backward: the gradient w.r.t. the input and w.r.t. the weights each
    cost one forward, except for the first layer, whose input (the images) needs no gradient."""
    import torch
    from torch import nn

    from common.model import build_model

    model = build_model(seed=0, in_channels=in_channels, image_size=image_size, num_classes=num_classes, dropout=0.0)
    layers: list[dict[str, Any]] = []

    def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
        if isinstance(module, nn.Conv2d):
            k = module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
            macs = output[0].numel() * k
        else:
            macs = module.in_features * module.out_features
        layers.append({"layer": name_of[module], "forward": 2 * macs})

    name_of = {m: n for n, m in model.named_modules()}
    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    with torch.no_grad():
        model(torch.zeros(1, in_channels, image_size, image_size))
    for h in handles:
        h.remove()
    for i, layer in enumerate(layers):
        layer["backward"] = layer["forward"] * (1 if i == 0 else 2)
    total = sum(layer["forward"] + layer["backward"] for layer in layers)
    return {"train_flops_per_sample": total, "layers": layers}


def pipeline_ceiling(
    layers: Sequence[dict[str, Any]], *, stage_counts: Sequence[int], peak_one_thread_gflops: float
) -> dict[str, dict[str, Any]]:
    """The fastest a pipeline can train here with one thread per rank, per number of stages: its heaviest
    stage (the scripts' own cut: split_model, stage_starts) runs on one core, at best at the 1-thread matmul
    peak, and every sample passes through it. `layers` are model_flops()'s; layers without FLOPs count as
    free, so this is an upper bound. With r pipeline replicas on r or more cores the bound is r times this."""
    from common.model import build_model
    from common.model_sizes import max_stages, stage_starts
    from common.pipeline import split_model

    flops = {layer["layer"]: layer["forward"] + layer["backward"] for layer in layers}
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.0)
    ceiling = {}
    for n in stage_counts:
        if not 1 <= n <= max_stages("baby"):
            continue
        pieces = split_model(model, stage_starts("baby", n))
        heaviest = max(pieces, key=lambda piece: sum(flops.get(name, 0) for name in piece._modules))
        stage_flops = sum(flops.get(name, 0) for name in heaviest._modules)
        ceiling[str(n)] = {
            "heaviest_stage": list(heaviest._modules),
            "train_flops_per_sample": stage_flops,
            "samples_per_s": peak_one_thread_gflops * 1e9 / stage_flops,
        }
    return ceiling
