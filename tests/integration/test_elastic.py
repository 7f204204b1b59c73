"""Elastic training on one machine standing in for two: two torchrun agents (NNODES=1:2, 2 processes each)
meet through the c10d rendezvous; one "machine" dies (its agent and its workers SIGKILLed at once) and the
survivor restarts alone from the latest checkpoint, with the same global batch, and finishes the curve; a
machine that comes back is taken in at the next restart, and the curve goes on at 4 processes."""

import contextlib
import os
import signal
import socket
import subprocess
import time

import pytest

from tests.helpers import (
    ROOT,
    SMALL,
    Run,
    env_for_tests,
    last_logged_step,
    losses,
    max_abs_diff,
    read_run,
    run_command,
)

# 50 steps of a global batch of 96 (24 per rank on 4 ranks, 48 on 2), a checkpoint every 10: the machine dies
# after step 25, well before the end
STEPS = 50
ELASTIC = [
    *SMALL,
    "--dropout",
    "0",
    "--lr",
    "1e-4",
    "--max-steps",
    str(STEPS),
    "--epochs",
    "5",
    "--batch-size",
    "96",
    "--checkpoint-every",
    "10",
]


# In the shared launches (tests/integration/conftest.py): the uninterrupted run, on one process (plain
# training: the curve every world size must reproduce, whichever strategy and however the world changes)
POOLED = {"reference": Run("ddp", ELASTIC, nproc=1)}


@pytest.fixture(scope="module")
def reference(pool):
    return pool / "elastic" / "reference"


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


def start_agent(strategy: str, out, port: int, **extra: str) -> subprocess.Popen:
    env = {**env_for_tests(), "NNODES": "1:2", "NPROC": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    # a survivor re-forms its group after RDZV_LAST_CALL_S (default 10 s); 3 s keeps the test short and still
    # lets the second agent, started 1 s after the first, join the first round
    env.update({"RDZV_LAST_CALL_S": "3", **extra})
    return subprocess.Popen(
        ["bash", f"run_{strategy}.sh", *ELASTIC, "--out", str(out)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_survivor_of_a_lost_machine_finishes_the_same_curve(strategy, reference, tmp_path):
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
        kill_all(survivor, doomed)
    assert len(losses(out)) == STEPS, printed[-6000:]  # every step once (read_metrics fails on a step logged twice)
    assert max_abs_diff(losses(out), losses(reference)) <= 1e-4
    assert read_run(out)["world_size"] == 2 and not (tmp_path / "elastic.1").exists()  # the survivor resumed


def kill_all(*agents: subprocess.Popen) -> None:
    for agent in agents:
        for pid in [agent.pid, *descendants(agent.pid)] if agent.poll() is None else []:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_machine_that_comes_back_is_taken_in_at_the_next_restart(reference, tmp_path):
    out, port = tmp_path / "elastic", free_port()
    # one machine starts alone (NNODES=1:2 lets it, after a short last call for others) on 2 processes
    first = start_agent("ddp", out, port, RDZV_LAST_CALL_S="1")
    second = None
    try:
        deadline = time.monotonic() + 240
        while last_logged_step(out) < 15:
            assert time.monotonic() < deadline and first.poll() is None, first.communicate()[0][-3000:]
            time.sleep(0.05)
        # the second machine comes (back): the first agent sees it waiting, restarts its workers, and the
        # group of 4 resumes from the latest checkpoint
        second = start_agent("ddp", out, port)
        printed = [agent.communicate(timeout=240)[0] for agent in (first, second)]
        assert first.returncode == 0 and second.returncode == 0, printed[0][-3000:] + printed[1][-3000:]
    finally:
        kill_all(first, *([second] if second else []))
    # taken in at a restart that resumed the run (a fresh start would have moved it aside to elastic.1)
    assert "resumed from" in printed[0] + printed[1] and not (tmp_path / "elastic.1").exists()
    assert read_run(out)["world_size"] == 4  # finished by both machines
    assert len(losses(out)) == STEPS  # every step once
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
