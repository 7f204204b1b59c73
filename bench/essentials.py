"""What clipping and --compile cost: real trainings, several per launch, alternated so noise hits them alike.

    python -m bench.essentials clip --procs 4 --steps 60 --repeats 2     # --max-grad-norm 1 vs 0, every script
    python -m bench.essentials clip-call                                 # the clipping call alone, 1 process
    python -m bench.essentials compile --procs 1 --strategies ddp,fsdp   # --compile vs eager
    python -m bench.essentials compile --procs 4 --strategies pippy
    python -m bench.essentials stop-check --procs 2                      # the per-step preemption check alone

Each launch runs the real `train_<strategy>.train` for each configuration, one after another, in one set of
processes (`worker`, below); the figures are medians of `step_time_s` from metrics.jsonl after the first
--skip steps (the compiled runs' first steps include compiling: the first run's, with an empty inductor cache,
are reported apart).
With --max-grad-norm 0 the global norm is still computed (it is logged), so `clip` measures the scaling;
`clip-call` times the whole call (norm + scaling) on BabyCNN's gradients, to set beside a step's time.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(spec: str) -> None:
    import torch

    from common.cli import parse_config
    from common.distributed import setup_distributed, teardown_distributed

    runs = json.loads(Path(spec).read_text())
    env = setup_distributed(timeout_s=300)
    try:
        for out, (strategy, flags) in runs.items():
            cfg = parse_config(strategy, [*flags, "--out", out], world_size=env.world_size)
            torch.set_num_threads(cfg.threads or torch.get_num_threads())
            importlib.import_module(f"train_{strategy}").train(cfg, env)
    finally:
        teardown_distributed()


def launch(runs: dict[str, tuple[str, list[str]]], procs: int) -> None:
    spec = Path(tempfile.mkstemp(suffix=".json")[1])
    spec.write_text(json.dumps(runs))
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs)] if procs > 1 else []
    cmd = [sys.executable, *torchrun, "-m", "bench.essentials", "worker", str(spec)]
    # a fresh inductor cache: the first compiled run pays the whole compile, as on a new machine
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, stdout=subprocess.DEVNULL)


def step_times(out: str) -> list[float]:
    records = [json.loads(line) for line in Path(out, "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r["step_time_s"] for r in records if r["kind"] == "train"]


def measure(configs: dict[str, tuple[str, list[str]]], args) -> dict[str, list[list[float]]]:
    """{name: [step times of each repeat]} for configs {name: (strategy, flags)}, alternated per repeat."""
    root = Path(tempfile.mkdtemp(prefix="essentials-"))
    runs = {
        str(root / f"{name}-{r}"): (strategy, [*flags, "--max-steps", str(args.steps), "--log-every", "1000"])
        for r in range(args.repeats)
        for name, (strategy, flags) in configs.items()
    }
    launch(runs, args.procs)
    return {name: [step_times(str(root / f"{name}-{r}")) for r in range(args.repeats)] for name in configs}


def median_after(times: list[list[float]], skip: int) -> float:
    return statistics.median(t for run in times for t in run[skip:])


def clip(args) -> None:
    configs = {}
    for strategy in args.strategies.split(","):
        configs[f"{strategy} off"] = (strategy, ["--max-grad-norm", "0"])
        configs[f"{strategy} on"] = (strategy, ["--max-grad-norm", "1.0"])
    times = measure(configs, args)
    print(f"| script ({args.procs} processes) | median step, --max-grad-norm 0 | with 1.0 | cost |")
    print("|---|---|---|---|")
    for strategy in args.strategies.split(","):
        off, on = (median_after(times[f"{strategy} {k}"], args.skip) for k in ("off", "on"))
        print(f"| {strategy} | {off * 1e3:.2f} ms | {on * 1e3:.2f} ms | {(on / off - 1) * 100:+.1f} % |")


def clip_call(args) -> None:
    import torch

    from common.clipping import clip_grad_norm
    from common.model import build_model

    torch.set_num_threads(1)
    from common.config import Config
    from common.data import load_dataset

    data = load_dataset(Config(train_size=128, test_size=128))
    model = build_model(seed=0, in_channels=data.in_channels, image_size=data.image_size, num_classes=10, dropout=0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(args.calls):
        started = time.perf_counter()
        clip_grad_norm(model.parameters(), 1.0)
        times.append(time.perf_counter() - started)
    n = sum(p.numel() for p in model.parameters())
    print(f"clip_grad_norm on BabyCNN's {n:,} gradients, 1 thread: median {statistics.median(times) * 1e3:.3f} ms")


def compile_(args) -> None:
    configs = {}
    for strategy in args.strategies.split(","):
        configs[f"{strategy} eager"] = (strategy, [])
        configs[f"{strategy} compiled"] = (strategy, ["--compile"])
    times = measure(configs, args)
    print(
        f"| script ({args.procs} processes) | eager median step | compiled | speed-up | compiled: first steps, cold |"
    )
    print("|---|---|---|---|---|")
    for strategy in args.strategies.split(","):
        eager, compiled = (median_after(times[f"{strategy} {k}"], args.skip) for k in ("eager", "compiled"))
        first = sum(times[f"{strategy} compiled"][0][: args.skip])  # the first run: with an empty cache
        print(
            f"| {strategy} | {eager * 1e3:.2f} ms | {compiled * 1e3:.2f} ms | {eager / compiled:.2f}x | {first:.1f} s |"
        )


def stop_check_worker(calls: int) -> None:
    from common.distributed import setup_distributed, stop_requested, teardown_distributed

    env = setup_distributed(timeout_s=300)
    try:
        for _ in range(20):  # warm-up: the first collectives set up gloo's pairs
            stop_requested()
        start = time.perf_counter()
        for _ in range(calls):
            stop_requested()
        if env.is_main:
            per_call = (time.perf_counter() - start) / calls
            print(f"stop_requested(): {per_call * 1e6:.0f} us per call on {env.world_size} processes ({calls} calls)")
    finally:
        teardown_distributed()


def stop_check(args) -> None:
    """What the preemption check after every step costs: one all-reduce of one number, read on the host."""
    torchrun = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.procs)]
    cmd = [sys.executable, *torchrun, "-m", "bench.essentials", "stop-check-worker", str(args.calls)]
    subprocess.run(cmd, cwd=ROOT, check=True)


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        return worker(sys.argv[2])
    if sys.argv[1:2] == ["stop-check-worker"]:
        return stop_check_worker(int(sys.argv[2]))
    parser = argparse.ArgumentParser(prog="python -m bench.essentials", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=["clip", "clip-call", "compile", "stop-check"])
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--strategies", default="ddp,fsdp,pippy")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    {"clip": clip, "clip-call": clip_call, "compile": compile_, "stop-check": stop_check}[args.what](args)


if __name__ == "__main__":
    main()
