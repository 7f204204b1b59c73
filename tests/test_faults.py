"""Faults on real processes: a worker SIGKILLed mid-run, torchrun restarts the group, the run resumes."""

import os
import re
import signal
import subprocess
import time

import pytest

from tests.helpers import ROOT, SMALL, env_for_tests, launch, losses, max_abs_diff, read_metrics

# 80 steps of 16 per epoch, a checkpoint every 16: long enough to kill a worker well past the first checkpoint.
FLAGS = [*SMALL, "--dropout", "0", "--batch-size", "96", "--max-steps", "80", "--warmup-steps", "4",
         "--lr", "1e-4", "--checkpoint-every", "16"]
STRATEGIES = ["ddp"]


def _workers(out_dir: str) -> list[int]:
    """PIDs of the training workers (not the torchrun agent) writing to out_dir."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if out_dir in argv and "torch.distributed.run" not in argv and any(a.startswith("train_") for a in argv):
            pids.append(int(pid))
    return pids


def _last_step(out) -> int:
    try:
        return max(read_metrics(out)[0], default=0)
    except (OSError, ValueError):  # not there yet, or a line half-written
        return 0


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_sigkilled_worker_is_restarted_and_the_run_finishes_unchanged(strategy, tmp_path):
    reference, out = tmp_path / "reference", tmp_path / "killed"
    launch(f"train_{strategy}.py", 2, FLAGS, reference)
    env = {**env_for_tests(), "NPROC": "2", "MAX_RESTARTS": "1"}
    runner = subprocess.Popen(["bash", f"run_{strategy}.sh", *FLAGS, "--out", str(out)], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while _last_step(out) < 20 and time.monotonic() < deadline and runner.poll() is None:
            time.sleep(0.02)
        killed_at = _last_step(out)
        assert 20 <= killed_at < 80, f"could not catch the run between steps 20 and 80 (at {killed_at})"
        victim = _workers(str(out))[-1]
        os.kill(victim, signal.SIGKILL)
        output = runner.communicate(timeout=240)[0]
    finally:
        runner.kill()
    assert runner.returncode == 0, output[-4000:]
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", output)
    assert resumed and int(resumed.group(1)) % 16 == 0 and int(resumed.group(1)) >= 16, output[-3000:]
    # each step exactly once (read_metrics fails on a duplicate), all 80, and the same losses
    assert max_abs_diff(losses(out), losses(reference)) <= 1e-6
