"""What clipping and --compile cost: real trainings, several per launch, alternated so noise hits them alike.

    python -m bench.essentials clip --procs 4 --steps 60 --repeats 2     # --max-grad-norm 1 vs 0, every script
    python -m bench.essentials clip-call                                 # the clipping call alone, 1 process
    python -m bench.essentials compile --procs 1 --strategies ddp,fsdp   # --compile vs eager
    python -m bench.essentials compile --procs 4 --strategies pippy
    python -m bench.essentials stop-check --procs 2                      # the per-step preemption check alone

Each launch runs the real `train_<strategy>.train` for each configuration, one after another, in one set of
processes (`worker`); the figures are medians of `step_time_s` after the first --skip steps (the compiled runs'
first steps include compiling: the first run's, with an empty inductor cache, are reported apart). With
--max-grad-norm 0 the norm is still computed (it is logged), so `clip` measures the scaling; `clip-call` times the
whole call on BabyCNN's gradients.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.launches import failure, launch, records
from bench.machine import ROOT, launch_env, torchrun
from bench.report import md_table

Configs = dict[str, tuple[str, list[str]]]  # name -> (strategy, flags)
COLD = "compiled: first steps, cold"  # of the first compiled run, which found the inductor cache empty
TIMEOUT_S = 3600  # per launch: every configuration's run, one after another


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


def measure(configs: Configs, args: argparse.Namespace) -> dict[str, list[list[float]]]:
    """{name: [step times of each repeat]} for configs {name: (strategy, flags)}, alternated per repeat, all in one
    launch of `worker`."""
    root = Path(tempfile.mkdtemp(prefix="essentials-"))
    runs = {
        str(root / f"{name}-{r}"): (strategy, [*flags, "--max-steps", str(args.steps), "--log-every", "1000"])
        for r in range(args.repeats)
        for name, (strategy, flags) in configs.items()
    }
    (root / "runs.json").write_text(json.dumps(runs))
    python = torchrun(args.procs) if args.procs > 1 else [sys.executable]
    # a fresh inductor cache: the first compiled run pays the whole compile, as on a new machine
    env = launch_env(args.procs, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    cmd = [*python, "-m", "bench.essentials", "worker", str(root / "runs.json")]
    ended = launch(cmd, out=root, nproc=args.procs, timeout_s=TIMEOUT_S, env=env)
    if ended["returncode"] != 0:
        sys.exit(f"error: {failure(root, ended['returncode'])} (console: {root / 'console.log'})")
    step_times = lambda name, r: [rec["step_time_s"] for rec in records(root / f"{name}-{r}")]
    return {name: [step_times(name, r) for r in range(args.repeats)] for name in configs}


def median_after(times: list[list[float]], skip: int) -> float:
    return statistics.median(t for run in times for t in run[skip:])


def paired(args: argparse.Namespace, off: list[str], on: list[str]) -> list[tuple[str, float, float, float]]:
    """For each of --strategies: (it, the median step with the flags `off`, with `on`, the first --skip steps of the
    first run with `on`, which found the inductor cache empty)."""
    strategies = args.strategies.split(",")
    times = measure({f"{s} {k}": (s, flags) for s in strategies for k, flags in (("off", off), ("on", on))}, args)
    median = lambda name: median_after(times[name], args.skip)
    return [(s, median(f"{s} off"), median(f"{s} on"), sum(times[f"{s} on"][0][: args.skip])) for s in strategies]


def clip(args: argparse.Namespace) -> None:
    header = [f"script ({args.procs} processes)", "median step, --max-grad-norm 0", "with 1.0", "cost"]
    rows = [
        [s, f"{off * 1e3:.2f} ms", f"{on * 1e3:.2f} ms", f"{(on / off - 1) * 100:+.1f} %"]
        for s, off, on, _ in paired(args, ["--max-grad-norm", "0"], ["--max-grad-norm", "1.0"])
    ]
    print("\n".join(md_table(header, rows)))


def compile_(args: argparse.Namespace) -> None:
    header = [f"script ({args.procs} processes)", "eager median step", "compiled", "speed-up", COLD]
    rows = [
        [s, f"{eager * 1e3:.2f} ms", f"{compiled * 1e3:.2f} ms", f"{eager / compiled:.2f}x", f"{first:.1f} s"]
        for s, eager, compiled, first in paired(args, [], ["--compile"])
    ]
    print("\n".join(md_table(header, rows)))


def clip_call(args: argparse.Namespace) -> None:
    import torch

    from common.clipping import clip_grad_norm
    from common.model import build_model

    torch.set_num_threads(1)
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0)  # the default data set's
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(args.calls):
        started = time.perf_counter()
        clip_grad_norm(model.parameters(), 1.0)
        times.append(time.perf_counter() - started)
    n = sum(p.numel() for p in model.parameters())
    print(f"clip_grad_norm on BabyCNN's {n:,} gradients, 1 thread: median {statistics.median(times) * 1e3:.3f} ms")


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


def stop_check(args: argparse.Namespace) -> None:
    """What the preemption check after every step costs: one all-reduce of one number, read on the host."""
    cmd = [*torchrun(args.procs), "-m", "bench.essentials", "stop-check-worker", str(args.calls)]
    subprocess.run(cmd, cwd=ROOT, check=True)


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        return worker(sys.argv[2])
    if sys.argv[1:2] == ["stop-check-worker"]:
        return stop_check_worker(int(sys.argv[2]))
    commands = {"clip": clip, "clip-call": clip_call, "compile": compile_, "stop-check": stop_check}
    parser = argparse.ArgumentParser(prog="python -m bench.essentials", description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=list(commands))
    for flag, default in [("--procs", 4), ("--strategies", "ddp,fsdp,pippy"), ("--steps", 60), ("--repeats", 2)]:
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    commands[args.what](args)


if __name__ == "__main__":
    main()
