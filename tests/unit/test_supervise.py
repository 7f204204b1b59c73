"""The runners' supervisor (runner/supervise.py) on what torchrun and its workers print when a run fails: a stand-in
for torchrun prints the same lines, so each rule is checked in a fraction of a second. (The real runs, with
signals, are in tests/integration/test_interruptions.py.)"""

import subprocess
import sys

import pytest

from runner.supervise import HOLD_S
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


def supervise(
    tmp_path, stdout: str, stderr: str | list[str], code: int, torchrun: tuple[str, ...] = ()
) -> subprocess.CompletedProcess:
    """runner.supervise over a stand-in for torchrun that prints `stdout` and `stderr` (a list: its parts with more
    than the supervisor's quiet seconds between them) and exits `code`; `torchrun`: torchrun's options before the
    script, as runner/launch.sh passes them (the stand-in ignores them)."""
    parts = [stderr] if isinstance(stderr, str) else stderr
    pause = f"sys.stderr.flush(); time.sleep({HOLD_S + 0.5})"
    writes = f"; {pause}; ".join(f"sys.stderr.write({part!r})" for part in parts)
    child = f"import sys, time; print({stdout!r}, end=''); {writes}; sys.exit({code})"
    cmd = [sys.executable, "-c", child, *torchrun, "train_ddp.py", "--out", str(tmp_path / "run")]
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


def test_a_peer_s_lost_connection_waits_for_the_end_while_a_warning_does_not(tmp_path):
    """What a worker prints is passed on after a few quiet seconds (a warning must not wait for the run's end), but not
    a collective that failed because its peer is gone: torchrun can take seconds to stop the other workers after a
    SIGKILL, and the one line that names the SIGKILL says it all."""
    done = supervise(tmp_path, "", ["a warning\n", PEER_GONE, TORCHRUN_REPORT.format(code=-9)], 1)
    assert done.returncode == 137
    warning, line = done.stderr.splitlines()
    assert warning == "a warning" and line.startswith("error: rank 1 was killed by SIGKILL"), done.stderr


# --------------------------------------------------------------------------- the rendezvous store (several machines)
# torchrun's options on a machine other than NODE_RANK=0 (runner/launch.sh)
JOINS = ("--nnodes", "1:2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-conf", "is_host=0")
PEER_GONE = """[rank2]: Traceback (most recent call last):
[rank2]:   File "/x/train_ddp.py", line 155, in train
[rank2]: RuntimeError: [../gloo/transport/tcp/pair.cc:545] Read error [127.0.0.1]:41866: Connection reset by peer.
"""
# what torchrun 2.14.1 printed when the machine hosting the store was SIGKILLed (tests/integration/test_elastic.py),
# its paths and C++ frames cut short
STORE_GONE = """[W1124 17:21:21.659438830 TCPStore.cpp:138] [c10d] recvValueWithTimeout failed on SocketImpl(fd=3): \
Failed to recv, got 0 bytes. Connection was likely closed. Did the remote server shutdown or crash?
Exception raised from recvBytes at /x/torch/csrc/distributed/c10d/Utils.hpp:790 (most recent call first):
frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x9d (0x7f344135e60d in /x/torch/lib/libc10.so)

W1124 17:21:21.689000 21197 /x/dynamic_rendezvous.py:1346] The node 'localhost_21197_0' has failed to send a \
keep-alive heartbeat to the rendezvous 'babycnn' due to an error of type RendezvousConnectionError.
W1124 17:21:21.880000 21197 /x/multiprocessing/api.py:1028] Sending process 21247 closing signal SIGTERM
Traceback (most recent call last):
  File "/x/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 114, in _call_store
    return getattr(self._store, store_op)(*args, **kwargs)
torch.distributed.DistNetworkError: Broken pipe

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/elastic/rendezvous/dynamic_rendezvous.py", line 1269, in num_nodes_waiting
    self._state_holder.sync()
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed. \
See inner exception for details.
"""
# NNODES=2, no restarts: torchrun reports the workers' failure, after its shutdown found the store gone
SHUTDOWN_FAILED = """W1124 17:30:02.112000 3301 /x/dynamic_rendezvous.py:1298] The node 'localhost_3301_0' has \
failed to shutdown the rendezvous 'babycnn' due to an error of type RendezvousConnectionError.
"""


@pytest.mark.parametrize("ending", ["elastic", "fixed"])
def test_the_store_gone_is_one_line_naming_it(tmp_path, ending):
    """The machine with NODE_RANK=0 died: the survivors' workers lose their peers and their agent its rendezvous store.
    One line names the store and the runner that hosts it, and how to continue; no traceback."""
    stderr = PEER_GONE + (STORE_GONE if ending == "elastic" else SHUTDOWN_FAILED + TORCHRUN_REPORT.format(code=1))
    done = supervise(tmp_path, "", stderr, 1, JOINS)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: the rendezvous store at 127.0.0.1:29500 is gone"), line
    assert "the runner with NODE_RANK=0 on MASTER_ADDR, which hosts it, died or stopped" in line
    assert line.endswith(f"bash run_ddp.sh --out {tmp_path / 'run'} --resume")


def test_a_worker_s_own_error_is_not_blamed_on_the_store(tmp_path):
    """A rank said what went wrong, the run ended on every machine, and this agent found the store gone as it left:
    the worker's line is the one line."""
    line = "[rank 2] error: the loss is nan at step 3; lower --lr or use --precision fp32\n"
    done = supervise(tmp_path, "", line + PEER_GONE + STORE_GONE, 1, JOINS)
    assert done.returncode == 1 and done.stderr == line


STARTUP = """Traceback (most recent call last):
  File "/x/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 156, in _create_tcp_store
    store = TCPStore(
torch.distributed.DistNetworkError: {inner}

The above exception was the direct cause of the following exception:

Traceback (most recent call last):
  File "<frozen runpy>", line 198, in _run_module_as_main
  File "/x/torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py", line 180, in _create_tcp_store
torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the C10d store has failed.
"""


@pytest.mark.parametrize(
    "is_host, inner, named",
    [
        (
            "0",
            "The client socket has timed out after 60000ms while trying to connect to (127.0.0.1, 29500).",
            "no rendezvous store answered at 127.0.0.1:29500",
        ),
        (
            "1",
            "The server socket has failed to listen on any local network address. port: 29500, name: EADDRINUSE",
            "could not host the rendezvous store at 127.0.0.1:29500",
        ),
    ],
)
def test_a_store_that_is_not_there_at_the_start_is_one_line(tmp_path, is_host, inner, named):
    torchrun = (*JOINS[:-1], f"is_host={is_host},join_timeout=600")
    done = supervise(tmp_path, "", STARTUP.format(inner=inner), 1, torchrun)
    assert done.returncode == 1
    (line,) = done.stderr.splitlines()
    assert line.startswith("error: ") and named in line and inner.rstrip(".") in line, line
