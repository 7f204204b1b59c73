"""The benchmark's in-process measurements of the single-process step (docs/performance.md): the fast paths timed
side by side, and a torch.profiler op table. Each runs in a fresh process, `python -m bench.micro FUNCTION
JSON_KWARGS [keep_freed_memory]`: the allocator's state is part of what is measured."""

import functools
import json
import re
import resource
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from bench.launches import CORES, ROOT, launch_env

VARIANTS = "fp32 fp32+channels_last fp32+fused_adamw bf16 bf16+channels_last bf16+channels_last+fused_adamw".split()
KEEP_FREED = ["fp32", "fp32+fused_adamw", "bf16", "bf16+channels_last+fused_adamw"]  # with keep_freed_memory
OP_GROUPS = [  # torch.profiler op name -> what it is, first match wins
    ("convolution (forward)", re.compile(r"mkldnn_convolution|_convolution$|conv2d|convolution$")),
    ("convolution (backward)", re.compile(r"convolution_backward")),
    ("linear (addmm, mm)", re.compile(r"addmm|aten::mm$|aten::matmul|aten::linear")),
    ("LayerNorm", re.compile(r"layer_norm")),
    ("max-pool", re.compile(r"max_pool")),
    ("ReLU", re.compile(r"relu|threshold|clamp_min")),
    ("AdamW update", re.compile(r"sqrt|lerp|addcmul|addcdiv|_fused_adamw|aten::div$|aten::mul_$|aten::add_$")),
    ("dtype/layout copies", re.compile(r"copy_|to_copy|aten::clone|contiguous")),
]


@functools.lru_cache(maxsize=1)
def _batch(train_size: int, batch_size: int):
    """The first real batch of the default data set, as the scripts gather it."""
    import torch

    from common.config import Config
    from common.data import GlobalBatchSampler, load_dataset, to_device_batch

    data = load_dataset(Config(train_size=train_size, test_size=64))
    batch = GlobalBatchSampler(len(data.train), batch_size, seed=0).rank_batch(1, 0, 1)
    return to_device_batch(data.train, batch, data, torch.device("cpu"))


def _variant_step(variant: str, *, batch_size: int, train_size: int, threads: int) -> Callable:
    """One training step (forward, backward, AdamW) of a fast-path variant on a fixed real batch, warmed up."""
    import torch
    import torch.nn.functional as F

    from common.model import build_model

    torch.set_num_threads(threads)
    flags, (images, labels) = set(variant.split("+")), _batch(train_size, batch_size)
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.1)
    if "channels_last" in flags:
        model = model.to(memory_format=torch.channels_last)
        images = images.contiguous(memory_format=torch.channels_last)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused="fused_adamw" in flags or None)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled="bf16" in flags):
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()

    for _ in range(3):
        step()
    return step


def fast_path_steps(
    variants: Sequence[str], *, batch_size: int, threads: int, rounds: int, steps_per_round: int, train_size: int
) -> dict[str, Any]:
    """samples/s of each variant's step in interleaved rounds (median of the round means; 1 thread: CPU time)."""
    steps = {v: _variant_step(v, batch_size=batch_size, train_size=train_size, threads=threads) for v in variants}
    result = {v: {"round_means_s": [], "round_cpu_means_s": [], "page_faults": 0} for v in variants}
    for _ in range(rounds):
        for variant, step in steps.items():
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(steps_per_round):
                step()
            result[variant]["round_means_s"].append((time.perf_counter() - started) / steps_per_round)
            result[variant]["round_cpu_means_s"].append((time.process_time() - cpu_started) / steps_per_round)
            result[variant]["page_faults"] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    for v in result.values():
        v["step_s"] = statistics.median(v["round_cpu_means_s"] if threads == 1 else v["round_means_s"])
        v["samples_per_s"] = batch_size / v["step_s"]
        # pages the kernel had to map in (and zero) per step: memory malloc gave back
        v["page_faults_per_step"] = v.pop("page_faults") / (rounds * steps_per_round)
        v["vs_first"] = v["samples_per_s"] / result[variants[0]]["samples_per_s"]  # the first is set first
    clock = "process CPU time" if threads == 1 else "wall"
    return {"batch_size": batch_size, "threads": threads, "clock": clock, "variants": result}


def profile_step(variant: str, *, batch_size: int, threads: int, steps: int, train_size: int) -> dict[str, Any]:
    """torch.profiler over `steps` steps of one variant: self CPU time by op group and the top ops."""
    from torch.profiler import ProfilerActivity, profile

    step = _variant_step(variant, batch_size=batch_size, train_size=train_size, threads=threads)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    averages = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in averages)
    groups: dict[str, float] = {}
    for event in averages:
        group = next((g for g, pattern in OP_GROUPS if pattern.search(event.key)), "other")
        groups[group] = groups.get(group, 0.0) + event.self_cpu_time_total
    cost = lambda us: {"ms_per_step": us / steps / 1e3, "share": us / total}
    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        **dict(variant=variant, batch_size=batch_size, threads=threads, steps=steps),
        "self_cpu_ms_per_step": total / steps / 1e3,
        "groups": {g: cost(us) for g, us in sorted(groups.items(), key=lambda kv: -kv[1])},
        "top_ops": [{"op": e.key, "calls_per_step": e.count / steps, **cost(e.self_cpu_time_total)} for e in top],
    }


def in_fresh_process(name: str, *, keep_freed: bool = False, **kwargs: Any) -> dict[str, Any]:
    """fast_path_steps or profile_step(**kwargs), run by `python -m bench.micro` and read back from its output."""
    cmd = [sys.executable, "-m", "bench.micro", name, json.dumps(kwargs), *(["keep_freed_memory"] * keep_freed)]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    found = [line for line in proc.stdout.splitlines() if line.startswith("MICRO-RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(found[-1].split(" ", 1)[1])


def measure_in_process(batch_size: int, train_size: int, *, everything: bool, say: Callable) -> dict[str, Any]:
    """The report's in-process sections: fast_paths (each variant as is, and the fastest again in a process that
    keeps freed memory, as the scripts do), profile (and profile_bf16 with `everything`)."""
    say("fast paths and profile of the single-process step")
    # (batch, threads, rounds, steps per round); the second: one rank's share of a 4-process step on one thread
    report: dict[str, Any] = {"fast_paths": []}
    for b, threads, rounds, n in [(batch_size, CORES, 5, 3)] + ([(batch_size // 4, 1, 5, 4)] if everything else []):
        settings = dict(batch_size=b, threads=threads, rounds=rounds, steps_per_round=n, train_size=train_size)
        as_is = in_fresh_process("fast_path_steps", variants=VARIANTS, **settings)
        kept = in_fresh_process("fast_path_steps", variants=KEEP_FREED, keep_freed=True, **settings)
        for name, v in kept["variants"].items():  # against the plain fp32 step
            v["vs_first"] = v["samples_per_s"] / as_is["variants"]["fp32"]["samples_per_s"]
            as_is["variants"][f"{name}+keep_freed_memory"] = v
        report["fast_paths"].append(as_is)
    profiled = dict(batch_size=batch_size, threads=CORES, steps=10, train_size=train_size)
    for key, variant in [("profile", "fp32")] + ([("profile_bf16", "bf16")] if everything else []):
        report[key] = in_fresh_process("profile_step", variant=variant, **profiled)
    return report


if __name__ == "__main__":  # one measurement in a fresh process, for in_fresh_process
    name, kwargs, *options = sys.argv[1:]
    if "keep_freed_memory" in options:
        from common.distributed import keep_freed_memory  # what setup_distributed does in the scripts

        keep_freed_memory()
    measure = {"fast_path_steps": fast_path_steps, "profile_step": profile_step}[name]
    print("MICRO-RESULT " + json.dumps(measure(**json.loads(kwargs))))
