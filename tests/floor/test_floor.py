"""The smoke subset for the oldest torch the suite supports (common/versions.py's FLOOR): `.ci/run` installs it in a
second environment (requirements-floor.txt) and runs this module there, while the full suite runs on the newest
torch (this folder is not in pytest.ini's testpaths). Every runner for a few steps on 2 processes, a parity pair
and a bit-for-bit resume, expert parallelism against one process, and what needs a newer torch refused in one line,
by the runner and by the script."""

import sys
from pathlib import Path

import pytest

from common.versions import FLOOR, NEEDS_TP, NEEDS_V, installed
from tests.helpers import SMALL, assert_follows, assert_resumed, env_for_tests, grad_norms, losses, rewind, run_command

# 6 steps at a learning rate where strategies agree step by step (tests/helpers.py's PARITY), checkpoints at 3 and 6
FLAGS = [*SMALL, "--max-steps", "6", "--batch-size", "64", "--dropout", "0", "--lr", "1e-4"]
FLAGS += ["--warmup-steps", "2", "--checkpoint-every", "3"]


def runner(strategy: str, flags: list[str], out: Path, *, check: bool = True, nproc: int = 2):
    cmd = ["bash", f"run_{strategy}.sh", *flags, "--out", str(out)]
    return run_command(cmd, env={**env_for_tests(), "NPROC": str(nproc)}, check=check)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("floor")
    for strategy in ("ddp", "fsdp", "pippy"):
        runner(strategy, FLAGS, root / strategy)
    return root


def test_this_environment_has_the_floor_torch():
    assert installed() == FLOOR, f"this module checks torch {FLOOR}; {sys.executable} has {installed()}"


def test_ddp_fsdp_and_the_pipeline_train_and_agree(runs):
    assert_follows(runs / "fsdp", runs / "ddp", loss=1e-5, grad_norm=1e-4)
    assert_follows(runs / "pippy", runs / "ddp", loss=1e-5, grad_norm=1e-4)


def test_a_resume_repeats_the_run_bit_for_bit(runs, tmp_path):
    again = rewind(runs / "ddp", tmp_path / "ddp", 3)
    proc = runner("ddp", [*FLAGS, "--resume"], again)
    assert_resumed(again, 3, proc.stdout + proc.stderr, source=runs / "ddp")
    assert losses(again) == losses(runs / "ddp") and grad_norms(again) == grad_norms(runs / "ddp")


def test_expert_parallelism_follows_one_process(tmp_path):
    """train_ep.py's all-to-alls and the experts' FSDP units over the groups (2 x 2, --ep 2) on this torch: the same
    curve as the mixture of experts on one process."""
    moe = ["--model", "gpt", "--experts", "4", "--seq-len", "32", *FLAGS]
    run_command([sys.executable, "train_ddp.py", *moe, "--out", str(tmp_path / "one")])
    runner("ep", [*moe, "--ep", "2"], tmp_path / "ep", nproc=4)
    assert_follows(tmp_path / "ep", tmp_path / "one", loss=1e-5, grad_norm=1e-4)


@pytest.mark.parametrize(
    "cmd, need",
    [
        (["bash", "run_tp.sh", "--max-steps", "2"], NEEDS_TP),
        ([sys.executable, "train_tp.py", "--max-steps", "2"], NEEDS_TP),
        (["bash", "run_pippy.sh", "--schedule", "zbv", "--stages-per-rank", "2"], NEEDS_V),
        ([sys.executable, "train_pippy.py", "--tp", "2"], NEEDS_TP),
    ],
)
def test_what_needs_a_newer_torch_is_refused_in_one_line(cmd, need, tmp_path):
    proc = run_command([*cmd, "--out", str(tmp_path / "run")], env={**env_for_tests(), "NPROC": "2"}, check=False)
    (release, what, _) = need
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and f"{what} needs torch >= {release[0]}.{release[1]}" in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
