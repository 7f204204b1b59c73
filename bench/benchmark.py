"""Benchmark: every strategy against a conventional baseline and against the machine's matmul peak.

    python -m bench                      # the default suite (~10 min on 2 cores): runs/bench/bench.{json,md}
    python -m bench --all                # + every mode on 4 processes, more bf16, compile
    python -m bench --wait-quiet 600     # first wait (up to 600 s) until the 1-min load average is < 1
    python -m bench --only ddp,baseline --procs 1,2 --timed-steps 10
    python -m bench --quick              # seconds: tiny settings, for the smoke test

What it does, in this order:
1. Measures the matmul peak (a large square matmul, best of several) in fp32 and bf16, with 1 thread and
   with all cores: the ceiling that "achieved FLOP/s" is a fraction of.
2. Counts BabyCNN's training FLOPs per sample analytically (forward 2 x MACs of every Conv2d/Linear;
   backward twice that, except the first layer, whose input needs no gradient).
3. Replays the suite's single-process training loop in this process, with the suite's own sampler,
   `to_device_batch`, `global_mean` and `MetricsWriter`, timing each part of a step: the share of step time
   spent on data and logging. Then the fast paths on the same step, interleaved so that noise hits them
   alike: channels_last, bf16 autocast, fused AdamW, torch.compile; and a torch.profiler op table.
4. Launches the real scripts (`python train_x.py` for 1 process, `python -m torch.distributed.run
   --standalone --nproc-per-node N train_x.py` otherwise, `bash run_ddp.sh` for the default-length runs),
   and the conventional baseline (bench/baseline.py: DataLoader over a Dataset of PIL images with
   ToTensor + Normalize per sample, DistributedSampler with set_epoch, DDP, default threads) at the same
   global batch and process count. From each run's metrics.jsonl, after --warmup-steps, over
   --timed-steps: samples/s, median step time and its spread; from the launch to the first metrics record
   (polled every 20 ms); each rank's tensor memory (run.json) and peak RSS (/proc VmHWM, polled).
5. Writes bench.json (everything) and bench.md (the tables the README shows).

Sub-command used by the launches: `micro-worker` (one in-process measurement in a fresh process).

Timing on a shared machine is noise: the JSON records the load average before and after, and the
Markdown says when the machine was not quiet. So is a single launch (5-10 % from one to the next): the runs
the acceptance compares go in --repeats rounds, and each ratio to the baseline is also taken round by round.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
SCHEDULE_FLAGS = {  # the pipeline schedules and the flags each needs (stages per rank)
    "gpipe": [],
    "1f1b": [],
    "interleaved-1f1b": ["--stages-per-rank", "2"],
    "looped-bfs": ["--stages-per-rank", "2"],
    "interleaved-zb": ["--stages-per-rank", "2"],
    "zbv": ["--stages-per-rank", "2"],
    "dualpipev": ["--stages-per-rank", "2", "--n-microbatches", "8"],  # it needs micro-batches >= stages
}
SHARDINGS = ("full", "grad-op", "hybrid", "none")


# ============================================================================ the machine's ceiling
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
    stage (by the model's cut, STAGE_STARTS) runs on one core, at best at the 1-thread matmul peak, and every
    sample passes through it. `layers` are model_flops()'s; layers without FLOPs count as free, so this is
    an upper bound. With r pipeline replicas on r or more cores the bound is r times this."""
    from common.model import STAGE_STARTS, build_model, split_model

    flops = {layer["layer"]: layer["forward"] + layer["backward"] for layer in layers}
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.0)
    ceiling = {}
    for n in stage_counts:
        if n not in STAGE_STARTS:
            continue
        pieces = split_model(model, n)
        heaviest = max(pieces, key=lambda piece: sum(flops.get(name, 0) for name in piece._modules))
        stage_flops = sum(flops.get(name, 0) for name in heaviest._modules)
        ceiling[str(n)] = {
            "heaviest_stage": list(heaviest._modules),
            "train_flops_per_sample": stage_flops,
            "samples_per_s": peak_one_thread_gflops * 1e9 / stage_flops,
        }
    return ceiling


# ============================================================================ the suite's loop, replayed
def _world_of_one() -> None:
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@functools.lru_cache(maxsize=4)
def _suite_parts(train_size: int, batch_size: int):
    from common.data import GlobalBatchSampler, load_dataset

    data = load_dataset("digits", seed=0, train_size=train_size, test_size=64)
    return data, GlobalBatchSampler(len(data.train), batch_size, seed=0)


def loop_breakdown(
    *, batch_size: int, threads: int, steps: int, warmup: int, train_size: int, precision: str = "fp32"
) -> dict[str, Any]:
    """train_ddp.py's single-process step, timed part by part (median seconds over `steps` steps).

    data: sampler + to_device_batch; compute: zero_grad, forward, backward, optimizer step; loss reduction:
    global_mean (an all-reduce, and the host sync) + check_finite; logging: MetricsWriter.train."""
    import torch
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.config import Config
    from common.data import to_device_batch
    from common.metrics import MetricsWriter
    from common.model import build_model
    from common.training import autocast, build_optimizer, check_finite, global_mean, lr_at, set_lr

    torch.set_num_threads(threads)
    _world_of_one()
    cfg = Config(precision=precision, batch_size=batch_size)
    data, sampler = _suite_parts(train_size, batch_size)
    device = torch.device("cpu")
    model = DDP(build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=cfg.dropout))
    optimizer = build_optimizer(model.parameters(), cfg)
    parts: dict[str, list[float]] = {"data": [], "compute": [], "loss_reduction": [], "logging": [], "step": []}
    with tempfile.TemporaryDirectory() as out:
        metrics = MetricsWriter(out, enabled=True, total_steps=10**9, log_every=10**9)
        for step in range(1, warmup + steps + 1):
            t0 = time.perf_counter()
            indices = sampler.rank_batch(step, 0, 1)
            images, labels = to_device_batch(data.train, indices, data, device)
            t1 = time.perf_counter()
            set_lr(optimizer, lr_at(step, cfg))
            optimizer.zero_grad(set_to_none=True)
            with autocast(cfg, device):
                loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            t2 = time.perf_counter()
            value = global_mean(loss.detach())
            check_finite(value, step)
            t3 = time.perf_counter()
            metrics.train(step, loss=value, lr=cfg.lr, samples=batch_size, step_time_s=t3 - t0)
            t4 = time.perf_counter()
            if step > warmup:
                for key, seconds in (
                    ("data", t1 - t0),
                    ("compute", t2 - t1),
                    ("loss_reduction", t3 - t2),
                    ("logging", t4 - t3),
                    ("step", t4 - t0),
                ):
                    parts[key].append(seconds)
        metrics.close()
    total = sum(parts["step"])
    return {
        "batch_size": batch_size,
        "threads": threads,
        "precision": precision,
        "steps": steps,
        "median_s": {k: statistics.median(v) for k, v in parts.items()},
        "share": {k: sum(v) / total for k, v in parts.items() if k != "step"},
    }


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
    forward = torch.compile(model) if "compile" in flags else model
    bf16 = "bf16" in flags

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = F.cross_entropy(forward(images), labels)
        loss.backward()
        optimizer.step()

    return step


def fast_path_steps(
    variants: Sequence[str], *, batch_size: int, threads: int, rounds: int, steps_per_round: int, train_size: int
) -> dict[str, Any]:
    """samples/s of each variant's step, timed in interleaved rounds (median of the round means)."""
    import torch

    torch.set_num_threads(threads)
    steps, setup_s = {}, {}
    for variant in variants:
        started = time.perf_counter()
        steps[variant] = _variant_step(variant, batch_size=batch_size, train_size=train_size)
        for _ in range(3):  # warm-up; for compile, this is where it compiles
            steps[variant]()
        setup_s[variant] = time.perf_counter() - started
    means: dict[str, list[float]] = {v: [] for v in variants}
    cpu_means: dict[str, list[float]] = {v: [] for v in variants}
    faults = {v: 0 for v in variants}
    for _ in range(rounds):
        for variant in variants:
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            started, cpu_started = time.perf_counter(), time.process_time()
            for _ in range(steps_per_round):
                steps[variant]()
            means[variant].append((time.perf_counter() - started) / steps_per_round)
            cpu_means[variant].append((time.process_time() - cpu_started) / steps_per_round)
            faults[variant] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    result = {}
    for variant in variants:
        # with one thread, CPU time is the step's own work: robust to other processes sharing the cores
        step_s = statistics.median(cpu_means[variant] if threads == 1 else means[variant])
        result[variant] = {
            "step_s": step_s,
            "samples_per_s": batch_size / step_s,
            "round_means_s": means[variant],
            "round_cpu_means_s": cpu_means[variant],
            "warmup_s": setup_s[variant],
            # pages the kernel had to map in (and zero) per step: memory malloc gave back
            "page_faults_per_step": faults[variant] / (rounds * steps_per_round),
        }
    base = result[variants[0]]["samples_per_s"]
    for variant in variants:
        result[variant]["vs_first"] = result[variant]["samples_per_s"] / base
    return {
        "batch_size": batch_size,
        "threads": threads,
        "clock": "process CPU time" if threads == 1 else "wall",
        "variants": result,
    }


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
    top = sorted(averages, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "variant": variant,
        "batch_size": batch_size,
        "threads": threads,
        "steps": steps,
        "self_cpu_ms_per_step": total / steps / 1e3,
        "groups": {
            g: {"ms_per_step": t / steps / 1e3, "share": t / total}
            for g, t in sorted(groups.items(), key=lambda kv: -kv[1])
        },
        "top_ops": [
            {
                "op": e.key,
                "calls_per_step": e.count / steps,
                "ms_per_step": e.self_cpu_time_total / steps / 1e3,
                "share": e.self_cpu_time_total / total,
            }
            for e in top
        ],
    }


def conv_diagnosis(*, threads: int) -> dict[str, Any]:
    """Which oneDNN kernels conv2 (32->64 channels, 3x3, 26x26) gets in each dtype and memory format, and
    how much of their time goes to reorders (layout conversions) -- read from ONEDNN_VERBOSE."""
    code = (
        "import torch, torch.nn.functional as F, sys\n"
        f"torch.set_num_threads({threads})\n"
        "dt = {'fp32': torch.float32, 'bf16': torch.bfloat16}[sys.argv[1]]\n"
        "fmt = torch.channels_last if sys.argv[2] == 'channels_last' else torch.contiguous_format\n"
        "x = torch.randn(128, 32, 26, 26).to(dt).contiguous(memory_format=fmt).requires_grad_()\n"
        "w = torch.randn(64, 32, 3, 3).to(dt).contiguous(memory_format=fmt).requires_grad_()\n"
        "for i in range(4):\n"
        "    if i == 3: print('ONEDNN-MARK', file=sys.stderr, flush=True); print('ONEDNN-MARK', flush=True)\n"
        "    F.conv2d(x, w).sum().backward()\n"
    )
    result = {}
    for dtype in ("fp32", "bf16"):
        for fmt in ("nchw", "channels_last"):
            proc = subprocess.run(
                [sys.executable, "-c", code, dtype, fmt],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "ONEDNN_VERBOSE": "1"},
            )
            lines = proc.stdout.split("ONEDNN-MARK", 1)[-1].splitlines()
            kernels, reorder_ms, conv_ms = [], 0.0, 0.0
            for line in lines:
                fields = line.split(",")
                if not line.startswith("onednn_verbose") or "exec" not in fields or len(fields) < 6:
                    continue
                kind, impl, ms = fields[fields.index("exec") + 2], fields[fields.index("exec") + 3], float(fields[-1])
                if kind == "reorder":
                    reorder_ms += ms
                elif kind == "convolution":
                    conv_ms += ms
                    kernels.append(impl)
            result[f"{dtype} {fmt}"] = {"conv_kernels": kernels, "conv_ms": conv_ms, "reorder_ms": reorder_ms}
    return result


def import_check(*, out: Path) -> dict[str, Any]:
    """`python -X importtime train_ddp.py` on the default data set: is torchvision imported, and what do the
    imports cost?"""
    proc = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",
            "train_ddp.py",
            "--max-steps",
            "1",
            "--train-size",
            "256",
            "--test-size",
            "64",
            "--out",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=_launch_env(),
    )
    cumulative: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        match = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|(\s*)(\S+)", line)
        if match:
            cumulative[match.group(4)] = int(match.group(2))
    top = {name: us for name, us in cumulative.items() if "." not in name}
    return {
        "ok": proc.returncode == 0,
        "torchvision_imported": any(n.split(".")[0] == "torchvision" for n in cumulative),
        "PIL_imported": "PIL" in top,
        "modules": len(cumulative),
        "top_level_import_s": {n: round(us / 1e6, 3) for n, us in sorted(top.items(), key=lambda kv: -kv[1])[:6]},
    }


MICRO = {"loop_breakdown": loop_breakdown, "fast_path_steps": fast_path_steps, "profile_step": profile_step}


def micro_worker(argv: Sequence[str]) -> None:
    """`micro-worker FUNCTION JSON_KWARGS [keep_freed_memory]`: one in-process measurement in a fresh process
    (the allocator's state is part of what is measured: the benchmark's own big matmuls would change it)."""
    name, kwargs, *options = argv
    if "keep_freed_memory" in options:
        from common.distributed import keep_freed_memory  # what setup_distributed does in the scripts

        keep_freed_memory()
    result = MICRO[name](**json.loads(kwargs))
    print("MICRO-RESULT " + json.dumps(result))


def in_fresh_process(name: str, *, keep_freed: bool = False, **kwargs: Any) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "bench", "micro-worker", name, json.dumps(kwargs)]
    proc = subprocess.run(
        cmd + (["keep_freed_memory"] if keep_freed else []),
        cwd=ROOT,
        env=_launch_env(),
        capture_output=True,
        text=True,
        timeout=900,
    )
    found = [line for line in proc.stdout.splitlines() if line.startswith("MICRO-RESULT ")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return json.loads(found[-1].split(" ", 1)[1])


# ============================================================================ launching the real scripts
@dataclass
class RunSpec:
    name: str  # the row's label
    strategy: str  # ddp, fsdp, pippy, baseline
    nproc: int
    args: list[str] = field(default_factory=list)
    precision: str = "fp32"
    launcher: str = "torchrun"  # python (1 process), torchrun, run_ddp.sh
    full: bool = False  # the default-length run: its test accuracy counts
    scaling: bool = False  # a run the acceptance compares: launched --repeats times, in rounds

    @property
    def script(self) -> str:
        return {"ddp": "train_ddp.py", "fsdp": "train_fsdp.py", "pippy": "train_pippy.py"}.get(self.strategy, "")

    def command(self, common_args: list[str], out: Path) -> list[str]:
        args = [
            *self.args,
            *(["--precision", self.precision] if self.precision != "fp32" else []),
            *common_args,
            "--out",
            str(out),
        ]
        if self.launcher == "run_ddp.sh":
            return ["bash", "run_ddp.sh", *args]
        if self.strategy == "baseline":
            target = ["-m", "bench.baseline"]
        else:
            target = [self.script]
        if self.nproc == 1 and self.launcher != "torchrun":
            return [sys.executable, *target, *args]
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(self.nproc),
            *target,
            *args,
        ]


def _launch_env(nproc: int = 1) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**env, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable, "NPROC": str(nproc)}


def _process_table() -> dict[int, int]:
    """pid -> parent pid, for every process."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def _sample_rss(root_pid: int, nproc: int, peaks: dict[int, int]) -> None:
    """Record the peak RSS (VmHWM) of each rank among root_pid's descendants, keyed by rank."""
    parents = _process_table()
    family, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in family:
                family.add(child)
                frontier.append(child)
    for pid in family:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        except (OSError, StopIteration, ValueError):
            continue
        rank = int(environ[b"RANK"]) if b"RANK" in environ else (0 if nproc == 1 and pid == root_pid else None)
        if rank is not None:
            peaks[rank] = max(peaks.get(rank, 0), hwm)


def launch_and_watch(cmd: list[str], *, out: Path, nproc: int, timeout_s: float) -> dict[str, Any]:
    """Run `cmd`, noting when the first record appears in out/metrics.jsonl and each rank's peak RSS."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    peaks: dict[int, int] = {}
    with open(out / "console.log", "w") as console:
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=_launch_env(nproc), stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        first_record_s, polls = None, 0
        while proc.poll() is None:
            if first_record_s is None and metrics.exists() and metrics.stat().st_size > 0:
                first_record_s = time.perf_counter() - started
            if polls % 10 == 0:
                _sample_rss(proc.pid, nproc, peaks)
            polls += 1
            if time.perf_counter() - started > timeout_s:
                os.killpg(proc.pid, 9)  # the whole session we started: torchrun and its workers
                proc.wait()
                break
            time.sleep(0.02)
        wall_s = time.perf_counter() - started
    return {
        "returncode": proc.returncode,
        "wall_s": wall_s,
        "first_record_s": first_record_s,
        "peak_rss_bytes": [peaks.get(r) for r in range(nproc)],
    }


def read_train_records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])


def timing_stats(records: list[dict[str, Any]], *, warmup: int, batch_size: int) -> dict[str, Any]:
    """Throughput and step-time distribution over the records after the first `warmup` steps."""
    timed = [r for r in records if r["step"] > warmup]
    if not timed:
        return {}
    times = sorted(r["step_time_s"] for r in timed)

    def quantile(q: float) -> float:
        return times[min(len(times) - 1, max(0, round(q * (len(times) - 1))))]

    stats = {
        "timed_steps": len(timed),
        "samples_per_s": batch_size * len(timed) / sum(times),
        "step_time_s": {
            "median": statistics.median(times),
            "p10": quantile(0.1),
            "p90": quantile(0.9),
            "min": times[0],
            "max": times[-1],
            "mean": statistics.fmean(times),
        },
    }
    if all("data_time_s" in r for r in timed):
        stats["data_share"] = sum(r["data_time_s"] for r in timed) / sum(times)
    return stats


def run_one(
    spec: RunSpec,
    *,
    work: Path,
    warmup: int,
    timed: int,
    batch_size: int,
    test_size: int,
    train_size: int,
    timeout_s: float,
    attempt: int = 0,
) -> dict[str, Any]:
    name = f"{spec.name}_{spec.precision}_x{spec.nproc}" + (f"_launch{attempt}" if attempt else "")
    out = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    shutil.rmtree(out, ignore_errors=True)
    row: dict[str, Any] = {**asdict(spec), "out": str(out)}
    if spec.script and not (ROOT / spec.script).exists():
        return {**row, "ok": False, "error": f"{spec.script} does not exist (yet)"}
    # Every run builds the default data set (train_size): its size changes the allocator's history, and that
    # changes the step time (see keep_freed_memory); the quick smoke test builds a small one.
    data = ["--train-size", str(train_size)] if train_size else []
    if spec.full:
        common_args = ["--batch-size", str(batch_size)]
    elif spec.strategy == "baseline":
        common_args = ["--max-steps", str(warmup + timed), "--batch-size", str(batch_size), *data]
    else:
        common_args = [
            "--max-steps",
            str(warmup + timed),
            "--batch-size",
            str(batch_size),
            "--log-every",
            "100000",
            "--test-size",
            str(test_size),
            *data,
        ]
    cmd = spec.command(common_args, out)
    row["command"] = " ".join(cmd).replace(sys.executable, "python")
    watched = launch_and_watch(cmd, out=out, nproc=spec.nproc, timeout_s=timeout_s)
    records = read_train_records(out)
    row.update(watched)
    if watched["returncode"] != 0:
        lines = (out / "console.log").read_text().strip().splitlines()
        # the script's own one-line error if there is one, else the last lines of the console
        said = [
            m.group(1)
            for line in lines
            if (m := re.search(r"(?:^|\]:? )((?:\w*Error|error): .*)", line.strip())) and "ChildFailedError" not in line
        ]
        why = said[0].strip() if said else " | ".join(lines[-4:])
        return {**row, "ok": False, "error": f"exit {watched['returncode']}: {why}"}
    row["ok"] = True
    row.update(timing_stats(records, warmup=warmup, batch_size=batch_size))
    if records and watched["first_record_s"] is not None:
        row["launch_to_first_step_s"] = watched["first_record_s"] - records[0]["step_time_s"]
    run_json = out / "run.json"
    if run_json.exists():
        info = json.loads(run_json.read_text())
        row["threads_per_process"] = info.get("threads_per_process")
        row["tensor_bytes_per_rank"] = [
            m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in info["memory"]["per_rank"]
        ]
        row["test_accuracy"] = (info.get("final") or {}).get("test_accuracy")
        bubble = (info.get("pipeline") or {}).get("bubble")
        if bubble:  # the pipeline's own measurement: how busy each rank was
            row["pipeline_bubble"] = {
                "measured": bubble.get("measured"),
                "busy_fraction_per_rank": bubble.get("busy_fraction_per_rank"),
            }
    return row


def default_plan(
    procs: Sequence[int], *, modes_procs: int, full_runs: bool, threads_check: bool, bf16: bool, more_bf16: bool = False
) -> list[RunSpec]:
    """The runs of the benchmark. Scaling (every process count in `procs`) for the baseline, DDP, FSDP (full)
    and the pipeline (1F1B); every other FSDP mode and pipeline schedule on `modes_procs` processes."""
    n = max(procs)
    plan: list[RunSpec] = []
    for p in procs:
        launcher = "python" if p == 1 else "torchrun"
        plan.append(RunSpec("baseline", "baseline", p, launcher=launcher, scaling=True))
        # at the largest count, as a user starts it (bash run_ddp.sh): its launch time is an acceptance line
        plan.append(RunSpec("ddp", "ddp", p, launcher="run_ddp.sh" if p == n and p > 1 else launcher, scaling=True))
        if bf16 and p == 1:  # right after its fp32 twin: the bf16 speed-up is a ratio of neighbours
            plan.append(RunSpec("ddp", "ddp", 1, precision="bf16", launcher="python", scaling=True))
        plan.append(RunSpec("fsdp full", "fsdp", p, ["--sharding", "full"], launcher=launcher, scaling=True))
        if p > 1:  # a pipeline needs at least two ranks to be one
            plan.append(RunSpec("pipeline 1f1b", "pippy", p, ["--schedule", "1f1b"], scaling=True))
        if p >= 4 and p % 2 == 0:
            # two pipelines of p/2 stages, each on half the batch (on 4 processes: 2 micro-batches of 32, the
            # size of the 4-stage pipeline's). With fewer cores than ranks, two heavy stages keep two cores busy.
            plan.append(
                RunSpec(
                    f"pipeline 1f1b, 2 replicas × {p // 2} stages",
                    "pippy",
                    p,
                    ["--schedule", "1f1b", "--dp", "2", "--n-microbatches", str(max(2, p // 2))],
                    scaling=True,
                )
            )
    m = modes_procs
    for sharding in SHARDINGS[1:]:
        if sharding != "hybrid" or m % 2 == 0:
            plan.append(RunSpec(f"fsdp {sharding}", "fsdp", m, ["--sharding", sharding]))
    plan.append(RunSpec("fsdp full, a unit per block", "fsdp", m, ["--sharding", "full", "--shard-units", "blocks"]))
    for schedule, flags in SCHEDULE_FLAGS.items():
        if schedule != "1f1b":
            plan.append(RunSpec(f"pipeline {schedule}", "pippy", m, ["--schedule", schedule, *flags]))
    if bf16:
        # the default run in bf16, all of it: its test accuracy is an acceptance line
        plan.append(RunSpec("ddp", "ddp", n, precision="bf16", launcher="run_ddp.sh", full=full_runs))
        if more_bf16:
            plan.append(RunSpec("fsdp full", "fsdp", n, ["--sharding", "full"], precision="bf16"))
            plan.append(RunSpec("pipeline 1f1b", "pippy", n, ["--schedule", "1f1b"], precision="bf16"))
    if threads_check and n > CORES:
        plan.append(RunSpec(f"ddp, {CORES} threads/rank", "ddp", n, ["--threads", str(CORES)]))
    return plan


# ============================================================================ report
def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _launches(row: dict[str, Any]) -> str:
    each = [v for v in row.get("samples_per_s_of_each_launch", []) if v]
    return f" ({min(each):.0f}–{max(each):.0f} over {len(each)} launches)" if len(each) > 1 else ""


def _round_ratios(row: dict[str, Any]) -> str:
    each = row.get("vs_baseline_each_round")
    return f" ({min(each):.2f}–{max(each):.2f} by round)" if each else ""


def _baseline_speeds(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Process count -> the baseline's samples/s (its median launch)."""
    return {r["nproc"]: r["samples_per_s"] for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}


def annotate(rows: list[dict[str, Any]], *, flops_per_sample: float, peaks: dict[str, float]) -> None:
    """Add achieved GFLOP/s, its fraction of the machine's peak, and the ratio to the baseline."""
    baseline = _baseline_speeds(rows)
    each_baseline = {r["nproc"]: r.get("samples_per_s_of_each_launch", []) for r in rows if r["strategy"] == "baseline"}
    fp32_twin = {(r["name"], r["nproc"], r["launcher"]): r for r in rows if r["precision"] == "fp32"}
    for row in rows:
        if not row.get("samples_per_s"):
            continue
        row["model_gflops"] = row["samples_per_s"] * flops_per_sample / 1e9
        peak = peaks.get(row["precision"])
        row["peak_fraction"] = row["model_gflops"] / peak if peak else None
        if row["nproc"] in baseline:
            row["vs_baseline"] = row["samples_per_s"] / baseline[row["nproc"]]
            rounds = zip(row.get("samples_per_s_of_each_launch", []), each_baseline.get(row["nproc"], []))
            ratios = [a / b for a, b in rounds if a and b]
            if len(ratios) > 1 and row["strategy"] != "baseline":
                row["vs_baseline_each_round"] = ratios
        twin = fp32_twin.get((row["name"], row["nproc"], row["launcher"]))
        if row["precision"] == "bf16" and twin and twin.get("samples_per_s"):  # the bf16 speed-up, side by side
            row["vs_fp32"] = row["samples_per_s"] / twin["samples_per_s"]
            rounds = zip(row.get("samples_per_s_of_each_launch", []), twin.get("samples_per_s_of_each_launch", []))
            row["vs_fp32_each_round"] = [a / b for a, b in rounds if a and b]


def markdown(report: dict[str, Any]) -> str:
    m, s = report["machine"], report["settings"]
    lines = [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average (1 min) before: "
        f"{m['load_before'][0]:.2f}; other processes used {m['other_processes_cores']:.2f} cores on average "
        f"during the {m['bench_wall_s']:.0f} s run"
        + ("" if m["quiet"] else " -- **not quiet: other work shared the cores, the figures are inflated**")
        + ".",
        "",
        f"Global batch {s['batch_size']}; {s['warmup_steps']} warm-up steps, then {s['timed_steps']} timed "
        f"(the full run: all steps after the warm-up). Matmul peak ({s['peak_n']}^3, best of "
        f"{s['peak_repeats']}): "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["peak_by_threads_gflops"].items())
        + " GFLOP/s; a run's % of peak is of the all-cores figure in its dtype"
        + f". Model: {report['model']['train_flops_per_sample'] / 1e6:.1f} MFLOP per sample (forward + backward).",
        "",
        "| run | precision | procs | samples/s | × baseline | step ms: median (p10–p90) | launch → 1st step s "
        "| tensors/rank MiB | peak RSS/rank MiB | GFLOP/s | % of peak | test acc |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["runs"]:
        if not r.get("ok"):
            lines.append(
                f"| {r['name']} | {r['precision']} | {r['nproc']} | failed: {r.get('error', '')[:120]} "
                "| | | | | | | | |"
            )
            continue
        st = r.get("step_time_s", {})
        name = r["name"] + (
            " (`run_ddp.sh`" + (", full run)" if r["full"] else ")") if r["launcher"] == "run_ddp.sh" else ""
        )
        rss = [v for v in r.get("peak_rss_bytes", []) if v]
        tensors = r.get("tensor_bytes_per_rank") or []
        lines.append(
            f"| {name} | {r['precision']} | {r['nproc']} | {_fmt(r.get('samples_per_s'), '.0f')}{_launches(r)} | "
            f"{_fmt(r.get('vs_baseline'), '.2f')}{_round_ratios(r)} | {_fmt(1e3 * st['median'], '.1f') if st else '-'} "
            f"({_fmt(1e3 * st['p10'], '.0f') if st else '-'}–{_fmt(1e3 * st['p90'], '.0f') if st else '-'}) | "
            f"{_fmt(r.get('launch_to_first_step_s'), '.1f')} | {_mib(max(tensors)) if tensors else '-'} | "
            f"{_mib(max(rss)) if rss else '-'} | {_fmt(r.get('model_gflops'), '.1f')} | "
            f"{_fmt(100 * r['peak_fraction'] if r.get('peak_fraction') else None, '.1f')} | "
            f"{_fmt(100 * r['test_accuracy'] if r.get('test_accuracy') is not None else None, '.2f')} |"
        )
    for r in report["runs"]:
        if r.get("vs_fp32"):
            each = r.get("vs_fp32_each_round") or []
            where = f"{r['name']} on {r['nproc']} process{'es' if r['nproc'] > 1 else ''}"
            lines += [
                "",
                f"bf16 against fp32, {where}, launched in the same rounds: {r['vs_fp32']:.2f}× (median "
                f"launches), {min(each):.2f}–{max(each):.2f}× by round."
                if len(each) > 1
                else f"bf16 against fp32, {where}: {r['vs_fp32']:.2f}× (one bf16 launch against the fp32 row).",
            ]
    scaling = report.get("scaling")
    if scaling:
        procs = sorted({p for row in scaling.values() for p in row}, key=int)
        lines += [
            "",
            "Scaling, fp32 samples/s (× the same run on 1 process):",
            "",
            "| run | " + " | ".join(f"{p} proc" for p in procs) + " |",
            "|---|" + "---|" * len(procs),
        ]
        for name, row in scaling.items():
            one = row.get("1")
            cells = [
                ("-" if row.get(p) is None else f"{row[p]:.0f}" + (f" ({row[p] / one:.2f}×)" if one else ""))
                for p in procs
            ]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ceiling_lines(report)
    loops = report.get("loop_breakdown")
    if loops:
        lines += [
            "",
            "Where a step goes (the suite's loop replayed in one process; share of step time):",
            "",
            "| per-process batch | threads | step ms | data | forward+backward+optimizer | loss all-reduce | logging |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in loops:
            sh = b["share"]
            lines.append(
                f"| {b['batch_size']} | {b['threads']} | {1e3 * b['median_s']['step']:.1f} | "
                f"{100 * sh['data']:.1f}% | {100 * sh['compute']:.1f}% | {100 * sh['loss_reduction']:.1f}% | "
                f"{100 * sh['logging']:.2f}% |"
            )
        base = [r for r in report["runs"] if r["strategy"] == "baseline" and r.get("data_share") is not None]
        if base:
            lines.append("")
            lines.append(
                "The baseline's DataLoader wait, share of its step time: "
                + ", ".join(f"{r['nproc']} proc {100 * r['data_share']:.0f}%" for r in base)
                + "."
            )
    for fast in report.get("fast_paths", []):
        one = fast["threads"] == 1
        lines += [
            "",
            f"Fast paths on one process's step (batch {fast['batch_size']}, {fast['threads']} thread"
            f"{'' if one else 's'}, {fast['clock']}, interleaved rounds):",
            "",
            "| variant | samples/s | × fp32 | GFLOP/s | % of its dtype's peak | page faults/step |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in fast["variants"].items():
            dtype = "bf16" if "bf16" in name else "fp32"
            peak = (
                report["peak_by_threads_gflops"][f"{dtype} 1 thread, CPU time"] if one else report["peak_gflops"][dtype]
            )
            gflops = v["samples_per_s"] * report["model"]["train_flops_per_sample"] / 1e9
            lines.append(
                f"| {name} | {v['samples_per_s']:.0f} | {v['vs_first']:.2f} | {gflops:.1f} | "
                f"{100 * gflops / peak:.1f}% | {v.get('page_faults_per_step', 0):.0f} |"
            )
    conv = report.get("conv_diagnosis")
    if conv:
        lines += [
            "",
            "conv2 (128×32×26×26, 3×3, forward + backward) in oneDNN (ONEDNN_VERBOSE; ms are one "
            "iteration's, single-shot):",
            "",
            "| dtype, layout | conv kernels | conv ms | reorder ms |",
            "|---|---|---|---|",
        ]
        for name, v in conv.items():
            lines.append(
                f"| {name} | {', '.join(sorted(set(v['conv_kernels'])))} | {v['conv_ms']:.1f} | {v['reorder_ms']:.1f} |"
            )
    prof = report.get("profile")
    if prof:
        lines += [
            "",
            f"Profile of the single-process fp32 step ({prof['variant']}, batch {prof['batch_size']}, "
            f"{prof['threads']} threads; torch.profiler self CPU time, {prof['self_cpu_ms_per_step']:.1f} ms/step):",
            "",
            "| op group | ms/step | share |",
            "|---|---|---|",
        ]
        for group, g in prof["groups"].items():
            lines.append(f"| {group} | {g['ms_per_step']:.1f} | {100 * g['share']:.1f}% |")
    imports = report.get("imports")
    if imports:
        lines += [
            "",
            f"Imports of `python train_ddp.py` (default data set, `-X importtime`): torchvision imported: "
            f"{'yes' if imports['torchvision_imported'] else 'no'}; PIL: {'yes' if imports['PIL_imported'] else 'no'}; "
            "slowest top-level imports: "
            + ", ".join(f"{k} {v:.2f} s" for k, v in imports["top_level_import_s"].items())
            + ".",
        ]
    return "\n".join(lines) + "\n"


def _replicas(row: dict[str, Any]) -> int:
    """A pipeline run's --dp (pipeline replicas)."""
    args = row.get("args", [])
    return int(args[args.index("--dp") + 1]) if "--dp" in args else 1


def ceiling_lines(report: dict[str, Any]) -> list[str]:
    """The pipeline rows against what one thread per rank allows them (pipeline_ceiling)."""
    ceiling, rows = report.get("pipeline_ceiling") or {}, report["runs"]
    baseline = _baseline_speeds(rows)
    pipelines = [
        r
        for r in rows
        if r.get("ok")
        and r["strategy"] == "pippy"
        and r["precision"] == "fp32"
        and r.get("samples_per_s")
        and r["args"][:2] == ["--schedule", "1f1b"]
    ]
    if not ceiling or not pipelines:
        return []
    peak = report["peak_by_threads_gflops"]["fp32 1 thread, CPU time"]
    lines = [
        "",
        f"The pipeline's ceiling with one thread per rank: every sample passes through the heaviest "
        f"stage, on one core, at best at the 1-thread fp32 matmul peak ({peak:.0f} GFLOP/s, CPU time), "
        "counting only conv and linear FLOPs (× the replicas, each on a core of its own):",
        "",
        "| run | procs | heaviest stage | MFLOP per sample | ceiling samples/s | measured | baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pipelines:
        replicas = _replicas(r)
        c = ceiling.get(str(r["nproc"] // replicas))
        if not c:
            continue
        bound = c["samples_per_s"] * min(replicas, report["machine"]["cores"])
        lines.append(
            f"| {r['name']} | {r['nproc']} | {', '.join(c['heaviest_stage'])} | "
            f"{c['train_flops_per_sample'] / 1e6:.1f} | {bound:.0f} | {r['samples_per_s']:.0f} | "
            f"{_fmt(baseline.get(r['nproc']), '.0f')} |"
        )
    return lines


def scaling_table(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("ok") and r["precision"] == "fp32" and r.get("samples_per_s") and "threads" not in r["name"]:
            table.setdefault(r["name"], {})[str(r["nproc"])] = r["samples_per_s"]
    return {k: v for k, v in table.items() if len(v) > 1}


def wait_until_quiet(max_wait_s: float) -> bool:
    deadline = time.time() + max_wait_s
    while os.getloadavg()[0] >= 1.0:
        if time.time() > deadline:
            return False
        time.sleep(10)
    return True


def _cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its waited-for descendants)."""
    with open("/proc/stat") as f:
        jiffies = [int(v) for v in f.readline().split()[1:]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system + own.children_user + own.children_system


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown CPU"


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["micro-worker"]:
        micro_worker(argv[1:])
        return
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--out", default="runs/bench", help="where bench.json, bench.md and the run folders go")
    parser.add_argument("--procs", default="1,2,4", help="process counts for the scaling runs")
    parser.add_argument("--only", default="", help="comma-separated strategies to launch (baseline,ddp,fsdp,pippy)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch of every run")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--timed-steps", type=int, default=30)
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="rounds of the runs the acceptance compares (baseline, DDP, FSDP full, pipeline 1F1B at "
        "every process count); each row reports its median launch (0: 3; --quick: 1)",
    )
    parser.add_argument(
        "--modes-procs",
        type=int,
        default=2,
        help="processes for the FSDP modes and pipeline schedules beyond the scaling runs (--all: the most)",
    )
    parser.add_argument(
        "--test-size", type=int, default=256, help="test set of the short runs (evaluated once, after timing)"
    )
    parser.add_argument("--no-full-runs", action="store_true", help="run bf16 DDP short too, not the whole default run")
    parser.add_argument("--no-bf16", action="store_true", help="skip the bf16 launches")
    parser.add_argument(
        "--compile", action="store_true", help="add torch.compile variants to the fast paths (slow to compile)"
    )
    parser.add_argument(
        "--all",
        action="store_true",
        help="also FSDP and pipeline in bf16, every mode and schedule "
        "on the most processes, a bf16 profile and --compile",
    )
    parser.add_argument("--micro-only", action="store_true", help="only the in-process measurements, no launches")
    parser.add_argument("--no-micro", action="store_true", help="only the launches, no in-process measurements")
    parser.add_argument("--quick", action="store_true", help="tiny settings: a smoke test of the benchmark itself")
    parser.add_argument("--wait-quiet", type=float, default=0, help="wait up to this many seconds for load < 1 first")
    parser.add_argument("--timeout-s", type=float, default=300, help="per launch")
    args = parser.parse_args(argv)

    import torch

    args.compile = args.compile or args.all
    args.repeats = args.repeats or (1 if args.quick else 3)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    quiet_wait = wait_until_quiet(args.wait_quiet) if args.wait_quiet else None
    procs = [int(p) for p in args.procs.split(",")]
    quick = args.quick
    if quick:  # a smoke test of the benchmark, not a measurement
        args.batch_size, args.warmup_steps, args.timed_steps = 32, 2, 3
    peak_n, peak_repeats = (512, 3) if quick else (2048, 8)
    train_size = 1024 if quick else 12800
    load_before = os.getloadavg()
    cpu_before = _cpu_seconds()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "settings": {**vars(args), "peak_n": peak_n, "peak_repeats": peak_repeats, "train_size": train_size}
    }

    def say(message: str) -> None:
        print(f"[bench {time.perf_counter() - started:6.1f} s] {message}", flush=True)

    say("matmul peak")
    peak_all = {
        f"{d} {t} thread{'s' if t > 1 else ''}": matmul_peak_gflops(d, t, n=peak_n, repeats=peak_repeats)
        for d in ("fp32", "bf16")
        for t in sorted({1, CORES})
    }
    peak_all.update(
        {
            f"{d} 1 thread, CPU time": matmul_peak_gflops(d, 1, n=peak_n, repeats=peak_repeats, clock=time.process_time)
            for d in ("fp32", "bf16")
        }
    )
    report["peak_by_threads_gflops"] = peak_all
    report["peak_gflops"] = {d: peak_all[f"{d} {CORES} thread{'s' if CORES > 1 else ''}"] for d in ("fp32", "bf16")}
    report["model"] = model_flops()
    flops = report["model"]["train_flops_per_sample"]

    say("the suite's loop, replayed: where a step goes")
    loop_settings = [(args.batch_size, CORES)] + ([] if quick else [(args.batch_size // 4, 1)])
    # a measurement runs in a fresh process (its allocator's history is part of the result); the smoke test
    # measures nothing, and saves the start-up of one
    measure = (lambda name, **kwargs: MICRO[name](**kwargs)) if quick else in_fresh_process
    report["loop_breakdown"] = (
        []
        if args.no_micro
        else [
            measure(
                "loop_breakdown",
                batch_size=b,
                threads=t,
                steps=3 if quick else 20,
                warmup=2 if quick else 5,
                train_size=train_size,
            )
            for b, t in loop_settings
        ]
    )
    if not quick and not args.no_micro:
        say("fast paths on the single-process step")
        variants = [
            "fp32",
            "fp32+channels_last",
            "fp32+fused_adamw",
            "bf16",
            "bf16+channels_last",
            "bf16+channels_last+fused_adamw",
        ]
        freed = ["fp32", "fp32+fused_adamw", "bf16", "bf16+channels_last+fused_adamw"]  # with keep_freed_memory
        if args.compile:
            variants += ["fp32+compile", "bf16+channels_last+compile"]
        report["fast_paths"] = []
        fast_settings = [(args.batch_size, CORES, 5, 3)] + ([(args.batch_size // 4, 1, 5, 4)] if args.all else [])
        for batch, threads, rounds, per_round in fast_settings:
            # the second: one rank's share of a 4-process step, on one thread, timed by CPU time
            settings = dict(
                batch_size=batch, threads=threads, rounds=rounds, steps_per_round=per_round, train_size=train_size
            )
            as_is = in_fresh_process("fast_path_steps", variants=variants if threads > 1 else variants[:6], **settings)
            kept = in_fresh_process("fast_path_steps", variants=freed, keep_freed=True, **settings)
            base = as_is["variants"]["fp32"]["samples_per_s"]
            for name, v in kept["variants"].items():
                as_is["variants"][f"{name}+keep_freed_memory"] = {**v, "vs_first": v["samples_per_s"] / base}
            report["fast_paths"].append(as_is)
        say("profile and oneDNN kernels")
        report["profile"] = in_fresh_process(
            "profile_step", variant="fp32", batch_size=args.batch_size, threads=CORES, steps=10, train_size=train_size
        )
        if args.all:
            report["profile_bf16"] = in_fresh_process(
                "profile_step",
                variant="bf16",
                batch_size=args.batch_size,
                threads=CORES,
                steps=10,
                train_size=train_size,
            )
        report["conv_diagnosis"] = conv_diagnosis(threads=CORES)
        say("imports")
        report["imports"] = import_check(out=out / "import_check")

    rows: list[dict[str, Any]] = []
    if not args.micro_only:
        if quick:
            plan = [
                RunSpec("ddp", "ddp", 1, launcher="python"),
                RunSpec("baseline", "baseline", 2),
                RunSpec("ddp", "ddp", 2),
            ]
        else:
            plan = default_plan(
                procs,
                modes_procs=max(procs) if args.all else args.modes_procs,
                full_runs=not args.no_full_runs,
                threads_check=True,
                bf16=not args.no_bf16,
                more_bf16=args.all,
            )
        if args.only:
            wanted = set(args.only.split(","))
            plan = [spec for spec in plan if spec.strategy in wanted]
        # The runs the acceptance compares are launched --repeats times, in rounds (every one of them once,
        # then again): a launch's speed moves by 5-10 % with the machine's state and the allocator's
        # history, and rounds let that noise hit the baseline and the strategies alike. Each row reports
        # its median launch; annotate() adds the ratio to the baseline of the same round.
        scaling = [spec for spec in plan if spec.scaling]
        order = [(i, spec) for i in range(args.repeats) for spec in scaling]
        order += [(0, spec) for spec in plan if not spec.scaling]
        launches: dict[int, list[dict[str, Any]]] = {id(spec): [] for spec in plan}
        for i, spec in order:
            say(
                f"{spec.name} {spec.precision} x{spec.nproc} ({spec.launcher})"
                + (f", round {i + 1} of {args.repeats}" if spec.scaling and args.repeats > 1 else "")
            )
            launch = run_one(
                spec,
                work=out,
                warmup=args.warmup_steps,
                timed=args.timed_steps,
                batch_size=args.batch_size,
                test_size=64 if quick else args.test_size,
                train_size=train_size if quick else 0,
                timeout_s=args.timeout_s,
                attempt=i,
            )
            if not launch["ok"]:
                say(f"  failed: {launch['error']}")
            else:
                say(
                    f"  {launch.get('samples_per_s', 0):.0f} samples/s, median step "
                    f"{1e3 * launch.get('step_time_s', {}).get('median', 0):.1f} ms"
                )
            launches[id(spec)].append(launch)
        for spec in plan:
            attempts = launches[id(spec)]
            done = sorted((a for a in attempts if a["ok"]), key=lambda a: a["samples_per_s"])
            row = done[len(done) // 2] if done else attempts[0]
            if len(attempts) > 1:  # in round order
                row["samples_per_s_of_each_launch"] = [a.get("samples_per_s") for a in attempts]
            rows.append(row)
    annotate(rows, flops_per_sample=flops, peaks=report["peak_gflops"])
    report["runs"] = rows
    report["scaling"] = scaling_table(rows)
    stage_counts = sorted({r["nproc"] // _replicas(r) for r in rows if r["strategy"] == "pippy"})
    report["pipeline_ceiling"] = pipeline_ceiling(
        report["model"]["layers"], stage_counts=stage_counts, peak_one_thread_gflops=peak_all["fp32 1 thread, CPU time"]
    )
    cpu_after, wall = _cpu_seconds(), time.perf_counter() - started
    # cores kept busy by processes that are not this benchmark's, on average over the benchmark
    others = max(0.0, (cpu_after[0] - cpu_before[0]) - (cpu_after[1] - cpu_before[1])) / wall
    report["machine"] = {
        "cpu": _cpu_name(),
        "cores": CORES,
        "torch": torch.__version__,
        "load_before": load_before,
        "other_processes_cores": others,
        "waited_for_quiet": quiet_wait,
        "quiet": load_before[0] < 1.0 and others < 0.1,
        "bench_wall_s": wall,
    }
    (out / "bench.json").write_text(json.dumps(report, indent=1))
    (out / "bench.md").write_text(markdown(report))
    say(f"wrote {out / 'bench.json'} and {out / 'bench.md'}")
    print(markdown(report))


if __name__ == "__main__":
    main()
