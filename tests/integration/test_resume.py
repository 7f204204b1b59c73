"""Resuming: a run resumed from its own checkpoint at the same world size repeats the uninterrupted run bit
for bit, for every strategy, at a learning rate where a 1-ulp difference would grow."""

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.helpers import (
    EXACT,
    SMALL,
    Run,
    assert_resumed,
    env_for_tests,
    grad_norms,
    launch,
    losses,
    printed,
    run_command,
)

STRATEGIES = ("ddp", "fsdp", "pippy", "tp")
# Trainings in the shared launches (tests/integration/conftest.py): each strategy's uninterrupted 40-step run on 2
# processes (test_interruptions.py's too: the pool trains them once), then the same run resumed from its step-20
# checkpoint in a fresh set of runs (a new DDP wrap, new shards, new stages), in a copy of the run folder as it
# stood after step 20
POOLED = {
    **{s: Run(s, EXACT, nproc=2) for s in STRATEGIES},
    **{f"{s}-resumed": Run(s, [*EXACT, "--resume"], nproc=2, rewound_from=(f"resume/{s}", 20)) for s in STRATEGIES},
}


@pytest.fixture(scope="module")
def resumed(pool):
    return pool / "resume"


def own_copy(run: Path, tmp_path: Path) -> Path:
    """A copy of a shared run for a test that launches into it: the shared folder is test_interruptions.py's
    uninterrupted run too (trained once, found under both names), which no test may write into."""
    return Path(shutil.copytree(run, tmp_path / run.name))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_at_the_same_world_size_repeats_the_run_bit_for_bit(resumed, strategy):
    again = resumed / f"{strategy}-resumed"
    assert_resumed(again, 20, printed(again), source=resumed / strategy)
    full = losses(resumed / strategy)
    assert len(full) == 40 and full[-1] < 0.5 * full[0]
    assert losses(again) == full and grad_norms(again) == grad_norms(resumed / strategy)  # after the resume too


def snapshot(folder: Path) -> dict[str, str]:
    """{relative path: SHA-256} of every file under `folder`."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.rglob("*") if f.is_file()
    }


@pytest.mark.parametrize(
    "changed, recorded",
    [
        (["--seed", "1"], "0"),
        (["--batch-size", "32"], "64"),
        (["--dataset", "mnist"], "digits"),
        (["--optimizer", "sgd"], "adamw"),
    ],
)
def test_resume_with_a_changed_trajectory_setting_is_refused_in_one_line(resumed, tmp_path, changed, recorded):
    """The runner refuses before torchrun starts (preflight), naming the flag and both values; nothing changes."""
    run = own_copy(resumed / "ddp", tmp_path)
    before = snapshot(run)
    proc = run_command(["bash", "run_ddp.sh", *EXACT, "--resume", *changed, "--out", str(run)], check=False)
    assert proc.returncode == 2 and proc.stdout == "" and "Traceback" not in proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: {changed[0]}:") and f"{changed[0]} {recorded}" in line and changed[1] in line
    assert snapshot(run) == before


def test_the_script_itself_refuses_a_changed_setting_and_stops_at_a_finished_run(resumed, tmp_path):
    """Launched without the runner (no preflight), the workers refuse too, and a finished run ends at once:
    exit 0, one line, no file changed."""
    ddp, fsdp = own_copy(resumed / "ddp", tmp_path), own_copy(resumed / "fsdp", tmp_path)
    before = {run: snapshot(run) for run in (ddp, fsdp)}
    refused = launch("train_ddp.py", 1, [*EXACT, "--resume", "--seed", "7"], ddp, check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.strip().splitlines() == [
        f"error: --seed: the run in {ddp} was trained with --seed 0, not 7; resume it with --seed 0, or "
        f"leave out --resume to start a new run (a resume must not mix two runs into one curve)"
    ]
    finished = launch("train_fsdp.py", 1, [*EXACT, "--resume"], fsdp)
    assert "already at step 40 of 40" in finished.stdout
    assert "2 -> 1 processes" in finished.stdout  # what a resume may change is said, once
    runner = run_command(["bash", "run_ddp.sh", *EXACT, "--resume", "--out", str(ddp)])
    assert runner.stdout.strip() == f"{ddp}: already at step 40 of 40; nothing to train (raise --max-steps or --epochs)"
    assert {run: snapshot(run) for run in (ddp, fsdp)} == before


def test_a_new_run_in_a_used_folder_moves_the_previous_run_aside(resumed, tmp_path):
    """No --resume into a folder holding a run: the runner (before torchrun) and the script run directly
    (rank 0, before any rank writes) each move the previous run to the next free numbered folder, untouched."""
    used = tmp_path / "run"
    shutil.copytree(resumed / "pippy", used)
    first = snapshot(used)
    proc = run_command(
        ["bash", "run_ddp.sh", *SMALL, "--max-steps", "3", "--out", str(used)], env={**env_for_tests(), "NPROC": "1"}
    )
    assert proc.stdout.splitlines()[0].startswith(f"{used} held a previous run: moved it to {used}.1")
    second = snapshot(used)
    assert snapshot(tmp_path / "run.1") == first and len(losses(used)) == 3
    proc = launch("train_ddp.py", 1, [*SMALL, "--max-steps", "2"], used)
    assert f"moved it to {used}.2" in proc.stdout
    assert snapshot(tmp_path / "run.1") == first and snapshot(tmp_path / "run.2") == second and len(losses(used)) == 2
