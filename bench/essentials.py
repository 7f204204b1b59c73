"""What clipping and --compile cost: real trainings, several per launch, alternated so noise hits them alike.

    python -m bench.essentials clip --procs 4 --steps 60 --repeats 2     # --max-grad-norm 1 vs 0, every script
    python -m bench.essentials compile --procs 1 --strategies ddp,fsdp   # --compile vs eager
    python -m bench.essentials compile --procs 4 --strategies pippy

One launch runs `train_<strategy>.train` for each configuration in turn (`worker`); the figures are medians of
`step_time_s` after the first --skip steps (the first compiled run's, an empty inductor cache, reported apart).
With --max-grad-norm 0 the norm is still computed (it is logged), so `clip` measures the scaling.
"""

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench.launches import Parser, failure, launch, launch_env, md_table, records, torchrun

TIMEOUT_S = 3600  # per launch: every configuration's run, one after another


def worker(runs: str) -> None:
    """One process of a launch: the trainings listed in the JSON file `runs`, one after another."""
    import torch

    from common.cli import parse_config
    from common.distributed import setup_distributed, teardown_distributed

    env = setup_distributed(timeout_s=300)
    try:
        for out, (strategy, flags) in json.loads(Path(runs).read_text()).items():
            cfg = parse_config(strategy, [*flags, "--out", out], world_size=env.world_size)
            torch.set_num_threads(cfg.threads or torch.get_num_threads())
            importlib.import_module(f"train_{strategy}").train(cfg, env)
    finally:
        teardown_distributed()


def paired(args: argparse.Namespace) -> None:
    """The table of `clip` or `compile`: each of --strategies, flags off and on, alternated in one launch."""
    clip, strategies = args.what == "clip", args.strategies.split(",")
    root = Path(tempfile.mkdtemp(prefix="essentials-"))
    off, on = (["--max-grad-norm", "0"], ["--max-grad-norm", "1.0"]) if clip else ([], ["--compile"])
    steps = ["--max-steps", str(args.steps), "--log-every", "1000"]
    names = {f"{s} {k}": (s, [*flags, *steps]) for s in strategies for k, flags in (("off", off), ("on", on))}
    runs = {str(root / f"{name}-{r}"): run for r in range(args.repeats) for name, run in names.items()}
    (root / "runs.json").write_text(json.dumps(runs))
    python = torchrun(args.procs) if args.procs > 1 else [sys.executable]
    # a fresh inductor cache: the first compiled run pays the whole compile, as on a new machine
    env = launch_env(args.procs, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="inductor-"))
    cmd = [*python, "-m", "bench.essentials", "worker", str(root / "runs.json")]
    ended = launch(cmd, out=root, nproc=args.procs, timeout_s=TIMEOUT_S, env=env)
    if ended["returncode"] != 0:
        sys.exit(f"error: {failure(root, ended['returncode'])} (console: {root / 'console.log'})")
    step_times = lambda name, r: [rec["step_time_s"] for rec in records(root / f"{name}-{r}")]
    times = {name: [step_times(name, r) for r in range(args.repeats)] for name in names}
    median = lambda name: statistics.median(t for run in times[name] for t in run[args.skip :])
    columns = ["median step, --max-grad-norm 0", "with 1.0", "cost"] if clip else ["eager median step", "compiled"]
    columns += [] if clip else ["speed-up", "compiled: first steps, cold"]
    rows = []
    for s in strategies:
        a, b = median(f"{s} off"), median(f"{s} on")
        cold = sum(times[f"{s} on"][0][: args.skip])  # the first compiled run's first steps: an empty inductor cache
        rows.append([s, f"{a * 1e3:.2f} ms", f"{b * 1e3:.2f} ms"])
        rows[-1] += [f"{(b / a - 1) * 100:+.1f} %"] if clip else [f"{a / b:.2f}x", f"{cold:.1f} s"]
    print("\n".join(md_table([f"script ({args.procs} processes)", *columns], rows)))


def main() -> None:
    if sys.argv[1:2] == ["worker"]:
        return worker(sys.argv[2])
    parser = Parser("python -m bench.essentials", __doc__.split("\n")[0])
    parser.add_argument("what", choices=["clip", "compile"])
    for flag, default in [("--procs", 4), ("--strategies", "ddp,fsdp,pippy"), ("--steps", 60), ("--repeats", 2)]:
        parser.add_argument(flag, type=type(default), default=default)
    parser.add_argument("--skip", type=int, default=5, help="first steps left out of the medians")
    paired(parser.parse(sys.argv[1:]))


if __name__ == "__main__":
    main()
