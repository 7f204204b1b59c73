"""In-process measurements of the single-process training step, without the scripts around it: the fast paths
(channels_last, bf16 autocast, fused AdamW) timed side by side, a torch.profiler op table, which oneDNN kernels
conv2 gets, and what `python train_ddp.py` imports. What the script's --compile costs is timed on the real
scripts, by `python -m bench.essentials compile`.

Each step measurement runs in a fresh process (`python -m bench.micro FUNCTION JSON_KWARGS [keep_freed_memory]`):
the allocator's state is part of what is measured, and the benchmark's own big matmuls would change it.
"""

from __future__ import annotations

import functools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.launches import launch
from bench.machine import CORES, ROOT, launch_env

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
# conv2 (32 -> 64 channels, 3x3, 26x26) forward and backward in a fresh process; its 4th pass is the one read
CONV2 = """import sys, torch, torch.nn.functional as F
torch.set_num_threads(int(sys.argv[3]))
dt = {'fp32': torch.float32, 'bf16': torch.bfloat16}[sys.argv[1]]
fmt = torch.channels_last if sys.argv[2] == 'channels_last' else torch.contiguous_format
x = torch.randn(128, 32, 26, 26).to(dt).contiguous(memory_format=fmt).requires_grad_()
w = torch.randn(64, 32, 3, 3).to(dt).contiguous(memory_format=fmt).requires_grad_()
for i in range(4):
    if i == 3: print('ONEDNN-MARK', file=sys.stderr, flush=True); print('ONEDNN-MARK', flush=True)
    F.conv2d(x, w).sum().backward()
"""


@functools.lru_cache(maxsize=4)
def _suite_parts(train_size: int, batch_size: int):
    from common.config import Config
    from common.data import GlobalBatchSampler, load_dataset

    data = load_dataset(Config(train_size=train_size, test_size=64))
    return data, GlobalBatchSampler(len(data.train), batch_size, seed=0)


def _variant_step(variant: str, *, batch_size: int, train_size: int) -> Callable[[], None]:
    """One training step (forward, backward, AdamW) of a fast-path variant, on a fixed real batch."""
    import torch
    import torch.nn.functional as F

    from common.data import to_device_batch
    from common.model import build_model

    flags = set(variant.split("+"))
    data, sampler = _suite_parts(train_size, batch_size)
    images, labels = to_device_batch(data.train, sampler.rank_batch(1, 0, 1), data, torch.device("cpu"))
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

    return step


def fast_path_steps(
    variants: Sequence[str], *, batch_size: int, threads: int, rounds: int, steps_per_round: int, train_size: int
) -> dict[str, Any]:
    """samples/s of each variant's step, timed in interleaved rounds (median of the round means)."""
    import torch

    torch.set_num_threads(threads)
    steps, result = {}, {}
    for variant in variants:
        started = time.perf_counter()
        steps[variant] = _variant_step(variant, batch_size=batch_size, train_size=train_size)
        for _ in range(3):  # warm-up
            steps[variant]()
        result[variant] = {"round_means_s": [], "round_cpu_means_s": [], "warmup_s": time.perf_counter() - started}
    faults = dict.fromkeys(variants, 0)
    for _ in range(rounds):
        for variant, step in steps.items():
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(steps_per_round):
                step()
            result[variant]["round_means_s"].append((time.perf_counter() - started) / steps_per_round)
            result[variant]["round_cpu_means_s"].append((time.process_time() - cpu_started) / steps_per_round)
            faults[variant] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    for variant, v in result.items():
        # with one thread, CPU time is the step's own work: robust to other processes sharing the cores
        v["step_s"] = statistics.median(v["round_cpu_means_s"] if threads == 1 else v["round_means_s"])
        v["samples_per_s"] = batch_size / v["step_s"]
        # pages the kernel had to map in (and zero) per step: memory malloc gave back
        v["page_faults_per_step"] = faults[variant] / (rounds * steps_per_round)
        v["vs_first"] = v["samples_per_s"] / result[variants[0]]["samples_per_s"]  # the first is set first
    clock = "process CPU time" if threads == 1 else "wall"
    return {"batch_size": batch_size, "threads": threads, "clock": clock, "variants": result}


def profile_step(variant: str, *, batch_size: int, threads: int, steps: int, train_size: int) -> dict[str, Any]:
    """torch.profiler over `steps` steps of one variant: self CPU time by op group and the top ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(threads)
    step = _variant_step(variant, batch_size=batch_size, train_size=train_size)
    for _ in range(3):
        step()
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


def conv_diagnosis(*, threads: int) -> dict[str, Any]:
    """Which oneDNN kernels conv2 gets in each dtype and memory format, and how much of their time goes to
    reorders (layout conversions), read from ONEDNN_VERBOSE."""
    result, env = {}, {**os.environ, "ONEDNN_VERBOSE": "1"}
    for dtype, fmt in [(d, f) for d in ("fp32", "bf16") for f in ("nchw", "channels_last")]:
        cmd = [sys.executable, "-c", CONV2, dtype, fmt, str(threads)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        result[f"{dtype} {fmt}"] = _onednn_times(proc.stdout.split("ONEDNN-MARK", 1)[-1].splitlines())
    return result


def _onednn_times(lines: Sequence[str]) -> dict[str, Any]:
    """The convolution kernels ONEDNN_VERBOSE's `exec` lines name, and their ms and the reorders' ms."""
    kernels, ms = [], {"reorder": 0.0, "convolution": 0.0}
    for line in lines:
        fields = line.split(",")
        if not line.startswith("onednn_verbose") or "exec" not in fields or len(fields) < 6:
            continue
        kind, impl = fields[fields.index("exec") + 2 : fields.index("exec") + 4]
        if kind in ms:
            ms[kind] += float(fields[-1])
        if kind == "convolution":
            kernels.append(impl)
    return {"conv_kernels": kernels, "conv_ms": ms["convolution"], "reorder_ms": ms["reorder"]}


def import_check(*, out: Path) -> dict[str, Any]:
    """`python -X importtime train_ddp.py` on the default data set: is torchvision imported, and what do the
    imports cost?"""
    flags = ["--max-steps", "1", "--train-size", "256", "--test-size", "64", "--out", str(out)]
    ended = launch([sys.executable, "-X", "importtime", "train_ddp.py", *flags], out=out, nproc=1, timeout_s=300)
    cumulative: dict[str, int] = {}
    for line in (out / "console.log").read_text().splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if match:
            cumulative[match.group(4)] = int(match.group(2))
    top = {name: us for name, us in cumulative.items() if "." not in name}
    return {
        "ok": ended["returncode"] == 0,
        "torchvision_imported": any(n.split(".")[0] == "torchvision" for n in cumulative),
        "PIL_imported": "PIL" in top,
        "modules": len(cumulative),
        "top_level_import_s": {n: round(us / 1e6, 3) for n, us in sorted(top.items(), key=lambda kv: -kv[1])[:6]},
    }


MICRO = {"fast_path_steps": fast_path_steps, "profile_step": profile_step}


def in_fresh_process(name: str, *, keep_freed: bool = False, **kwargs: Any) -> dict[str, Any]:
    """MICRO[name](**kwargs), run by `python -m bench.micro` and read back from its output."""
    keep = ["keep_freed_memory"] if keep_freed else []
    cmd = [sys.executable, "-m", "bench.micro", name, json.dumps(kwargs), *keep]
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=900)
    found = [line for line in proc.stdout.splitlines() if line.startswith("MICRO-RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(found[-1].split(" ", 1)[1])


def fast_paths(*, batch_size: int, threads: int, rounds: int, per_round: int, train_size: int) -> dict[str, Any]:
    """The fast-path table of one setting: every variant as is, and the fastest ones again in a process that
    keeps freed memory (as the scripts do), each against the plain fp32 step."""
    settings = dict(batch_size=batch_size, threads=threads, rounds=rounds, steps_per_round=per_round)
    as_is = in_fresh_process("fast_path_steps", variants=VARIANTS, train_size=train_size, **settings)
    kept = in_fresh_process("fast_path_steps", variants=KEEP_FREED, keep_freed=True, train_size=train_size, **settings)
    base = as_is["variants"]["fp32"]["samples_per_s"]
    for name, v in kept["variants"].items():
        as_is["variants"][f"{name}+keep_freed_memory"] = {**v, "vs_first": v["samples_per_s"] / base}
    return as_is


def measure_in_process(
    *, batch_size: int, train_size: int, everything: bool, out: Path, say: Callable[[str], None]
) -> dict[str, Any]:
    """The report's in-process sections: fast_paths, profile (and profile_bf16 with `everything`),
    conv_diagnosis and imports."""
    say("fast paths on the single-process step")
    # (batch, threads, rounds, steps per round); the second: one rank's share of a 4-process step, on one
    # thread, timed by CPU time
    settings = [(batch_size, CORES, 5, 3)] + ([(batch_size // 4, 1, 5, 4)] if everything else [])
    fast = [
        fast_paths(batch_size=b, threads=t, rounds=r, per_round=n, train_size=train_size) for b, t, r, n in settings
    ]
    report: dict[str, Any] = {"fast_paths": fast}
    say("profile and oneDNN kernels")
    profiled = dict(batch_size=batch_size, threads=CORES, steps=10, train_size=train_size)
    for key, variant in [("profile", "fp32")] + ([("profile_bf16", "bf16")] if everything else []):
        report[key] = in_fresh_process("profile_step", variant=variant, **profiled)
    report["conv_diagnosis"] = conv_diagnosis(threads=CORES)
    say("imports")
    report["imports"] = import_check(out=out / "import_check")
    return report


if __name__ == "__main__":  # one measurement in a fresh process, for in_fresh_process
    name, kwargs, *options = sys.argv[1:]
    if "keep_freed_memory" in options:
        from common.distributed import keep_freed_memory  # what setup_distributed does in the scripts

        keep_freed_memory()
    print("MICRO-RESULT " + json.dumps(MICRO[name](**json.loads(kwargs))))
