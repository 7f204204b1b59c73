"""The runners' supervisor: starts torchrun, passes its output on, and says in one line how a run ended.

`run_*.sh` end with `exec python -m runner.supervise -- python -m torch.distributed.run ... train_X.py FLAGS`, so
this process is the one a terminal, SLURM or Kubernetes signals, and it decides what each process gets, once:

- Ctrl-C (SIGINT) or a closed terminal (SIGHUP): torchrun gets SIGINT and stops its workers at once; then one
  line gives the step reached, the latest checkpoint and the command that continues; exit 130. A second Ctrl-C
  kills what is left.
- SIGTERM or --preempt-signal (USR1 by default), preemption: every worker gets it, the ranks agree to finish the
  step they are in, save a checkpoint of it and stop (`stop_requested` in common/distributed.py); torchrun sees
  them finish and exits 0; one line says so and how to continue; exit 128 + the signal's number. (Workers still
  starting, which have not set their handlers yet, have nothing to save: torchrun gets SIGTERM and stops them.)
- A worker that said what went wrong in one line ("error: ...", "out of memory"): the tracebacks that follow
  from the other ranks and torchrun's failure table only repeat it, and are held back; the worker's exit code.
- A worker killed by SIGKILL, which neither this process nor torchrun sends unasked: on Linux most likely the
  kernel's out-of-memory killer, and the line says so instead of torchrun's table; exit 137.
- On several machines, the rendezvous store gone (torchrun's RendezvousConnectionError): the machine that hosts
  it (NODE_RANK=0, at MASTER_ADDR) died or its runner stopped, and no agent can go on without it. One line names
  the store and says how to continue, instead of the workers' and torchrun's tracebacks; torchrun's exit code. At
  the start, a store that never answered or could not be hosted is one line too.
- Anything else is passed on as it is, torchrun's report and tracebacks included: a real error is never hidden.

torchrun runs in a session of its own, so a terminal's Ctrl-C reaches this process alone (not torchrun a second
time); it ignores SIGUSR1/SIGUSR2, whose default action would kill it when SLURM signals every process of a job,
and dies with this process (Linux). This module does not import torch.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shlex
import signal
import subprocess
import sys
import time
from typing import Sequence

from common.cli import parse_config
from common.config import PREEMPT_SIGNALS
from common.runs import latest_checkpoint_line

TORCHRUN_LOG = re.compile(rb"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ")  # torchrun's logger: "W1124 08:49:56.18 1485 ..."
TORCHRUN_SIGNALED = re.compile(rb"Received (?:Signals\.)?(\w+) death signal")  # torchrun itself got a signal
WORKERS_STOPPED = re.compile(rb"^stopped by SIG\w+ after step \d+")  # the ranks saved and stopped (the scripts)
ONE_LINE_ERROR = re.compile(rb"^(\[rank \d+\] )?(error: |out of memory )")  # common/distributed.py's `run`
# torchrun's agent lost its rendezvous store: its heartbeat, its poll of the rendezvous or its shutdown says so in a
# log line ("... due to an error of type RendezvousConnectionError"), or its closing traceback ends with it
STORE_LOST = b"RendezvousConnectionError"
# the exception under torchrun's RendezvousConnectionError, e.g. "torch.distributed.DistNetworkError: ... EADDRINUSE"
STORE_CAUSE = re.compile(r"^torch\.distributed\.\w+: (.+)$", re.M)
ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)
FAILURE = re.compile(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", re.S)  # each worker in torchrun's table
HOLD_S = 3.0
# a worker's collective failed because a peer process is gone (gloo, NCCL): it follows from that peer's end, which
# torchrun reports; held to the end even past HOLD_S (a SIGKILLed peer is then named in one line, torchrun may take
# seconds to stop the others)
PEER_LOST = re.compile(rb"Connection (?:closed|reset) by peer|\] (?:Read|Write) error|remote process exited")
RUNNER_ENV = ("NPROC", "NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "MAX_RESTARTS")


class Supervisor:
    def __init__(self, cmd: list[str]) -> None:
        script = next(i for i, arg in enumerate(cmd) if re.fullmatch(r"train_\w+\.py", os.path.basename(arg)))
        self.strategy = os.path.basename(cmd[script])[len("train_") : -len(".py")]
        self.flags = cmd[script + 1 :]
        cfg = parse_config(self.strategy, self.flags)  # (the preflight has checked them)
        self.out, self.preempt = cfg.out, (signal.SIGTERM, signal.Signals[f"SIG{cfg.preempt_signal}"])
        self.cmd = cmd
        self.proc: subprocess.Popen | None = None
        self.interrupted: str | None = None  # Ctrl-C or SIGHUP
        self.stopping: str | None = None  # a preemption signal, sent to us or to torchrun
        self.explained = False  # a worker said what went wrong in one line
        self.saved = False  # the workers stopped on a preemption signal, with a checkpoint
        self.started = False  # the workers have printed: their signal handlers are set (setup_distributed)
        # stderr: passed on once the run goes on or after HOLD_S quiet seconds; at the end held back if it only
        # follows from an error already said in one line, a stop, or a SIGKILL (a peer's "Connection reset")
        self.held: list[bytes] = []
        self.held_since = 0.0
        self.tail: list[bytes] | None = None  # torchrun's closing traceback, from its first line on
        self.store_lost = False  # torchrun's agent said it lost the rendezvous store: what follows, follows from it
        self.peer_lost = False  # a held line says a worker lost a peer: not passed on for quiet seconds alone
        torchrun = cmd[:script]
        self.endpoint = _option(torchrun, "--rdzv-endpoint")  # MASTER_ADDR:MASTER_PORT on several machines
        conf = dict(kv.split("=", 1) for kv in (_option(torchrun, "--rdzv-conf") or "").split(",") if "=" in kv)
        self.is_host = conf.get("is_host")  # "1" on NODE_RANK=0, "0" elsewhere, None: torch decides by address
        self.maybe_traceback: bytes | None = None

    # ---------------------------------------------------------------- signals
    def on_signal(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self.proc is None:
            return
        if signum in self.preempt:
            if not self.stopping:
                self.stopping = name
                workers = children(self.proc.pid) if self.started else []
                for pid in workers:  # each worker notes it; the ranks agree at the end of the step
                    _kill(pid, signum)
                if not workers:  # still starting, their handlers not yet set: nothing to save, torchrun stops them
                    _kill(self.proc.pid, signal.SIGTERM)
        elif not self.interrupted:
            self.interrupted = name
            _kill(self.proc.pid, signal.SIGINT)  # torchrun passes it to its workers: they stop at once
        else:  # a second Ctrl-C: no more waiting
            for pid in [self.proc.pid, *children(self.proc.pid)]:
                _kill(pid, signal.SIGKILL)

    # ---------------------------------------------------------------- output
    def line(self, stream: int, line: bytes) -> None:
        if self.interrupted:
            return  # the workers' and torchrun's last words: what they say, the line at the end says better
        if stream == 1:
            self.started = True
            self.saved = self.saved or bool(WORKERS_STOPPED.match(line))
            self._flush_held()
            _write(sys.stdout.buffer, line)
            return
        if self.tail is not None:
            self.tail.append(line)
            return
        if self.maybe_traceback is not None:  # is it torchrun's closing traceback? (torchrun runs as -m: runpy)
            first, self.maybe_traceback = self.maybe_traceback, None
            if b"<frozen runpy>" in line or b"torch/distributed/" in line:
                self.tail = [first, line]
                return
            self.held.append(first)  # a worker's
            self.held_since = self.held_since or time.monotonic()
        if line.startswith(b"Traceback (most recent call last)"):
            self.maybe_traceback = line
        elif m := TORCHRUN_SIGNALED.search(line):
            got = m.group(1).decode()  # "15" or "SIGTERM", as the Python version formats it
            self.stopping = self.stopping or (signal.Signals(int(got)).name if got.isdigit() else got)
        elif ONE_LINE_ERROR.match(line) and not (self.explained or self.stopping):
            self.explained = True  # what follows on stderr repeats it: held back
            _write(sys.stderr.buffer, line)
        else:  # held until the workers go on, or a few quiet seconds pass: see `run`
            if TORCHRUN_LOG.match(line) and STORE_LOST in line:
                self.store_lost = True  # then held to the end, with the workers' "Connection reset" before it: `end`
            self.peer_lost = self.peer_lost or bool(PEER_LOST.search(line))
            self.held.append(line)
            self.held_since = self.held_since or time.monotonic()

    def _flush_held(self) -> None:
        if self.held and not (self.explained or self.stopping or self.store_lost):
            for held in self.held:
                _write(sys.stderr.buffer, held)
            self.held.clear()
            self.peer_lost = False
        self.held_since = 0.0

    # ---------------------------------------------------------------- the run
    def run(self) -> int:
        for sig in {signal.SIGINT, signal.SIGHUP, *self.preempt}:
            signal.signal(sig, self.on_signal)
        self.proc = subprocess.Popen(
            self.cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True, preexec_fn=_torchrun_child
        )
        streams = {self.proc.stdout.fileno(): 1, self.proc.stderr.fileno(): 2}
        partial = {fd: b"" for fd in streams}
        with selectors.DefaultSelector() as selector:
            for fd in streams:
                selector.register(fd, selectors.EVENT_READ)
            while selector.get_map():
                for key, _ in selector.select(timeout=0.5):
                    chunk = os.read(key.fd, 1 << 16)
                    if not chunk:
                        selector.unregister(key.fd)
                        if partial[key.fd]:
                            self.line(streams[key.fd], partial[key.fd] + b"\n")
                        continue
                    *lines, partial[key.fd] = (partial[key.fd] + chunk).split(b"\n")
                    for line in lines:
                        self.line(streams[key.fd], line + b"\n")
                if self.held_since and not self.peer_lost and time.monotonic() - self.held_since > HOLD_S:
                    self._flush_held()  # the run is quiet: nothing more to decide by
        if self.maybe_traceback is not None:
            self.line(2, b"")
        return self.end(self.proc.wait())

    def end(self, code: int) -> int:
        """One line for how the run ended, and the exit code."""
        tail = b"".join(self.tail or []).decode(errors="replace")
        if self.interrupted:
            print(f"interrupted ({self.interrupted}) {self.where()}; {self.continue_with()}", file=sys.stderr)
            return 130
        if self.stopping and (self.saved or code != 0):  # (a signal during the final evaluation lets the run end)
            print(f"stopped by {self.stopping} {self.where()}; {self.continue_with()}", file=sys.stderr, flush=True)
            return 128 + signal.Signals[self.stopping].value
        cause = ROOT_CAUSE.search(tail) if code != 0 else None
        store_lost = code != 0 and (self.store_lost or STORE_LOST.decode() in tail)
        if self.explained and (cause or store_lost):  # (a store gone after a worker's error follows from it: a
            worker_code = int(cause.group(2)) if cause else code  # peer on the host machine failed too, and left)
            return worker_code if worker_code > 0 else 1
        if cause:
            # torchrun's "root cause" is the earliest failure to the second: a peer's collective error, seen in the
            # same poll as the SIGKILL that caused it, can take its place. Any SIGKILL in the table is the cause.
            killed = [int(rank) for rank, exit_code in FAILURE.findall(tail) if int(exit_code) == -signal.SIGKILL]
            if killed:
                rank = killed[0]
                print(
                    f"error: rank {rank} was killed by SIGKILL {self.where()}: nobody here sent it; on Linux it is most"
                    f" likely the kernel's out-of-memory killer (dmesg | grep -i oom). Try a smaller --batch-size or "
                    f"--model-size, or FSDP; {self.continue_with()}",
                    file=sys.stderr,
                )
                return 128 + signal.SIGKILL
        if store_lost and self.endpoint:
            print(self.store_line(tail), file=sys.stderr)
            return code
        for line in [*self.held, *(self.tail or [])]:  # a real failure: torchrun's report, as it wrote it
            _write(sys.stderr.buffer, line)
        return code

    def store_line(self, tail: str) -> str:
        """The one line for a rendezvous store that is gone, never answered, or could not be hosted here."""
        host = f"the runner {'with NODE_RANK=0 ' if self.is_host is not None else ''}on MASTER_ADDR"
        cause = STORE_CAUSE.search(tail)
        why = f" ({cause.group(1).strip().rstrip('.')})" if cause else ""
        if "_create_tcp_store" not in tail:  # torchrun had connected to it: the run had started
            return (
                f"error: the rendezvous store at {self.endpoint} is gone{why}: {host}, which hosts it, died or stopped"
                f" (its own output says why), and the others cannot go on without it; {self.where()}; start that"
                f" runner again, then here {self.continue_with()}"
            )
        if self.is_host == "1":
            return (
                f"error: this runner (NODE_RANK=0) could not host the rendezvous store at {self.endpoint}{why}: is"
                " another run using MASTER_PORT? Choose a free MASTER_PORT, the same on every machine"
            )
        return (
            f"error: no rendezvous store answered at {self.endpoint}{why}: start {host} (it hosts the store; the"
            " others wait a minute or two for it), with the same MASTER_ADDR and MASTER_PORT on every machine"
        )

    def where(self) -> str:
        """ "at step N (the latest checkpoint is ...)": from metrics.jsonl and the checkpoints."""
        step = 0
        try:
            with open(os.path.join(self.out, "metrics.jsonl")) as f:
                for line in f:
                    record = json.loads(line) if line.strip() else {}
                    step = record.get("step", step) if record.get("kind") == "train" else step
        except (OSError, ValueError):
            pass
        return f"at step {step} ({latest_checkpoint_line(self.out)})"

    def continue_with(self) -> str:
        flags = [f for f in self.flags if f != "--resume"]
        env = [f"{k}={shlex.quote(os.environ[k])}" for k in RUNNER_ENV if k in os.environ]
        runner = shlex.join(["bash", f"run_{self.strategy}.sh", *flags, "--resume"])
        return f"continue with: {' '.join([*env, runner])}"


def _option(args: list[str], name: str) -> str | None:
    """The value of torchrun's option `name` in `args` ("--rdzv-endpoint H:P", "--rdzv_endpoint=H:P"), or None."""
    names = (name, "--" + name[2:].replace("-", "_"))
    for i, arg in enumerate(args):
        if arg in names and i + 1 < len(args):
            return args[i + 1]
        if arg.split("=", 1)[0] in names and "=" in arg:
            return arg.split("=", 1)[1]
    return None


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`: torchrun's workers (each in a session of its own)."""
    if not os.path.isdir("/proc"):
        found = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        return [int(p) for p in found.split()]
    kids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:  # "pid (name) state ppid ...": the name may hold spaces
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue  # not a process, or gone meanwhile
    return kids


def _torchrun_child() -> None:
    """In torchrun's process, before it starts: SIGUSR1/2 ignored (its workers set their own handler), and on Linux a
    SIGTERM when this process dies, so that torchrun never outlives its supervisor."""
    for name in PREEMPT_SIGNALS:
        signal.signal(signal.Signals[f"SIG{name}"], signal.SIG_IGN)
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass  # gone already


def _write(stream, line: bytes) -> None:
    stream.write(line)
    stream.flush()


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    raise SystemExit(Supervisor(argv[argv.index("--") + 1 :]).run())


if __name__ == "__main__":
    main()
