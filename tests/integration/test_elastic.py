"""Elastic training on one machine standing in for two: two torchrun agents (NNODES=1:2, 2 processes each)
meet through the c10d rendezvous; one "machine" dies (its agent and its workers SIGKILLed at once) and the
survivor restarts alone from the latest checkpoint, with the same global batch, and finishes the curve."""

import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import ROOT, SMALL, env_for_tests, last_logged_step, losses, max_abs_diff, run_command, run_many

# 80 steps (5 epochs) of a global batch of 96 (24 per rank on 4 ranks, 48 on 2), a checkpoint every 10: the machine
# dies after step 25, well before the end
ELASTIC = [
    *SMALL,
    "--dropout",
    "0",
    "--lr",
    "1e-4",
    "--max-steps",
    "80",
    "--epochs",
    "5",
    "--batch-size",
    "96",
    "--checkpoint-every",
    "10",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (torchrun starts its workers in sessions of their own, so killing
    the agent's process group would leave them running as orphans)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def start_agent(strategy: str, out, port: int) -> subprocess.Popen:
    env = {**env_for_tests(), "NNODES": "1:2", "NPROC": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen(
        ["bash", f"run_{strategy}.sh", *ELASTIC, "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_survivor_of_a_lost_machine_finishes_the_same_curve(strategy, tmp_path):
    reference = tmp_path / "reference"
    run_many({reference: (strategy, ELASTIC)}, 4)
    out, port = tmp_path / "elastic", free_port()
    survivor = start_agent(strategy, out, port)
    time.sleep(1)  # the survivor hosts the rendezvous store (the first agent to bind MASTER_PORT)
    doomed = start_agent(strategy, out, port)
    try:
        deadline = time.monotonic() + 240
        while last_logged_step(out) < 25:
            assert time.monotonic() < deadline and survivor.poll() is None, survivor.communicate()[0][-3000:]
            time.sleep(0.05)
        for pid in [doomed.pid, *descendants(doomed.pid)]:  # the machine dies: its agent and workers at once
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        printed = survivor.communicate(timeout=150)[0]
        assert survivor.returncode == 0, printed[-4000:]
        assert time.monotonic() - killed_at < 150
    finally:
        for agent in (survivor, doomed):
            for pid in [agent.pid, *descendants(agent.pid)] if agent.poll() is None else []:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    assert len(losses(out)) == 80, printed[-6000:]  # every step once (read_metrics fails on a step logged twice)
    assert max_abs_diff(losses(out), losses(reference)) <= 1e-4


@pytest.mark.parametrize(
    "script, env, named",
    [
        ("run_ddp.sh", {"NPROC": "128"}, "NPROC=128: 128 CPU processes need"),  # more than memory holds
        ("run_fsdp.sh", {"NNODES": "2:1"}, "NNODES=2:1: MIN:MAX needs"),
        ("run_ddp.sh", {"NNODES": "1:2"}, "MASTER_ADDR is not set"),
        ("run_pippy.sh", {"NNODES": "1:2", "MASTER_ADDR": "127.0.0.1"}, "NNODES=1:2: elastic training is supported"),
    ],
)
def test_runner_refuses_what_it_cannot_launch_in_one_line(script, env, named):
    proc = run_command(["bash", script], env={**env_for_tests(), **env}, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and named in line
