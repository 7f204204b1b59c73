"""The runners' supervisor (runner/supervise.py) on what torchrun and its workers print when a run fails: a stand-in
for torchrun prints the same lines, so each rule is checked in a fraction of a second. (The real runs, with
signals, are in tests/integration/test_interruptions.py.)"""

import subprocess
import sys

import pytest

from tests.helpers import ROOT

WORKER_TRACEBACK = """[rank1]: Traceback (most recent call last):
[rank1]:   File "/x/train_ddp.py", line 9, in <module>
[rank1]: ZeroDivisionError: division by zero
"""
TORCHRUN_REPORT = """E1124 09:33:47.519000 24998 api.py:1002] failed (exitcode: {code}) local_rank: 1 (pid: 2)
Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/run.py", line 1142, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : {code} (pid: 2)
============================================================
"""


def supervise(tmp_path, stdout: str, stderr: str, code: int) -> subprocess.CompletedProcess:
    """runner.supervise over a stand-in for torchrun that prints `stdout` and `stderr` and exits `code`."""
    child = f"import sys; print({stdout!r}, end=''); sys.stderr.write({stderr!r}); sys.exit({code})"
    cmd = [sys.executable, "-c", child, "train_ddp.py", "--out", str(tmp_path / "run")]
    return subprocess.run(
        [sys.executable, "-m", "runner.supervise", "--", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_a_real_failure_is_passed_on_whole(tmp_path):
    done = supervise(tmp_path, "step 1\n", WORKER_TRACEBACK + TORCHRUN_REPORT.format(code=1), 1)
    assert done.returncode == 1 and done.stdout == "step 1\n"
    assert done.stderr == WORKER_TRACEBACK + TORCHRUN_REPORT.format(code=1)


@pytest.mark.parametrize("line", ["error: --lr: must be positive\n", "[rank 0] error: the loss is nan at step 3\n"])
def test_an_error_said_in_one_line_is_not_repeated(tmp_path, line):
    done = supervise(tmp_path, "", line + WORKER_TRACEBACK + TORCHRUN_REPORT.format(code=2), 1)
    assert done.returncode == 2 and done.stderr == line  # the worker's exit code, not torchrun's 1


def test_a_sigkill_is_named_in_one_line(tmp_path):
    done = supervise(tmp_path, "", WORKER_TRACEBACK + TORCHRUN_REPORT.format(code=-9), 1)
    assert done.returncode == 137
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: rank 1 was killed by SIGKILL at step 0 (no checkpoint was written")
    assert "out-of-memory killer" in line and line.endswith(f"bash run_ddp.sh --out {tmp_path / 'run'} --resume")


def test_a_run_that_ends_well_passes_everything_on(tmp_path):
    done = supervise(tmp_path, "done: test accuracy 99.00%\n", "a warning\n", 0)
    assert (done.returncode, done.stdout, done.stderr) == (0, "done: test accuracy 99.00%\n", "a warning\n")


def test_a_sigkill_seen_beside_its_peer_s_error_is_still_named(tmp_path):
    """torchrun's "root cause" is the earliest failure to the second: rank 0's "Connection reset" (exit 1), seen in the
    same poll as rank 1's SIGKILL, can take its place. The SIGKILL anywhere in the table is the cause."""
    report = """Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 3)
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 2)
"""
    done = supervise(tmp_path, "", WORKER_TRACEBACK + report, 1)
    assert done.returncode == 137 and done.stderr.startswith("error: rank 1 was killed by SIGKILL"), done.stderr
