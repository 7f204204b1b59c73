"""Launch the real scripts as the user would, and read what they wrote. Every launch has a timeout, so a
hung collective fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAUNCH_TIMEOUT_S = 240

# Small and fast, but the real thing: the built-in data set, cut down.
SMALL = ["--train-size", "1536", "--test-size", "256", "--log-every", "1000"]
# Step-by-step comparable runs: no dropout (its masks depend on the rank), fp32, and a learning rate at
# which the 1-process run is itself stable. AdamW divides each gradient element by its own running RMS, so
# elements whose gradient is mostly rounding noise (LayerNorm's per-position bias at rarely active
# positions) turn ~1e-7 summation-order differences into visible weight differences, which then grow from
# step to step: at --lr 2e-3 even 1- and 2-thread single-process runs drift apart by ~6e-3 within 24 steps;
# at 1e-4 they agree to ~6e-6 over 30 steps (measured here).
PARITY = [*SMALL, "--dropout", "0", "--max-steps", "24", "--batch-size", "96", "--warmup-steps", "4", "--lr", "1e-4"]


def env_for_tests() -> dict[str, str]:
    env = dict(os.environ, PYTHON=sys.executable, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("RANK", None)
    return env


def run_command(cmd: list[str], *, timeout: float = LAUNCH_TIMEOUT_S, env: dict[str, str] | None = None,
                check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=ROOT, env=env or env_for_tests(), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}"
                             f"\n--- stderr\n{proc.stderr[-5000:]}")
    return proc


def launch(script: str, nproc: int, args: list[str], out: Path, **kw) -> subprocess.CompletedProcess:
    """`python script` for nproc == 1, else torchrun --standalone with nproc processes."""
    if nproc == 1:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), script]
    return run_command([*cmd, *args, "--out", str(out)], **kw)


def read_metrics(out: Path) -> tuple[dict[int, dict], list[dict]]:
    """({step: train record}, [eval records]) from out/metrics.jsonl; fails on a step logged twice."""
    train, evals = {}, []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            assert record["step"] not in train, f"step {record['step']} logged twice in {out}"
            train[record["step"]] = record
        else:
            evals.append(record)
    return train, evals


def losses(out: Path) -> list[float]:
    train, _ = read_metrics(out)
    assert sorted(train) == list(range(1, len(train) + 1)), f"missing steps in {out}: {sorted(train)}"
    return [train[s]["loss"] for s in sorted(train)]


def max_abs_diff(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b), f"{len(a)} vs {len(b)} steps"
    return max(abs(x - y) for x, y in zip(a, b))


def read_run(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())
