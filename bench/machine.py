"""The machine the benchmarks run on: where the suite is, how many cores it may use, how busy the machine is,
and how a launched process is started. No torch here."""

from __future__ import annotations

import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def launch_env(nproc: int = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a launch, without what would tie it to a torchrun of ours: each launch
    picks its own threads (the scripts: cores / local processes) and its own rendezvous."""
    tied = ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if k not in tied}
    ours = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable, "NPROC": str(nproc)}
    return {**env, **ours, **extra}


def wait_until_quiet(max_wait_s: float) -> bool:
    """Wait until the 1-minute load average is below 1; False if it still is not after `max_wait_s`."""
    deadline = time.time() + max_wait_s
    while os.getloadavg()[0] >= 1.0:
        if time.time() > deadline:
            return False
        time.sleep(10)
    return True


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its waited-for descendants)."""
    with open("/proc/stat") as f:
        jiffies = [int(v) for v in f.readline().split()[1:]]
    busy = sum(jiffies) - jiffies[3] - jiffies[4]  # all but idle and iowait
    own = os.times()
    return busy / os.sysconf("SC_CLK_TCK"), own.user + own.system + own.children_user + own.children_system


def cpu_name() -> str:
    """The CPU's model name from /proc/cpuinfo, else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine() or "unknown CPU"


def peak_rss_bytes(pid: int | str = "self") -> int | None:
    """A process's peak resident memory (VmHWM in /proc/<pid>/status); None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        return None


class LoadWatch:
    """The machine's load over the benchmark: started before its first measurement, `summary()` after its last.
    Timing on a shared machine is noise, so the report says how much of the machine others used meanwhile."""

    def __init__(self, quiet_wait: bool | None) -> None:
        self.quiet_wait = quiet_wait
        self.load_before = os.getloadavg()
        self.cpu_before = cpu_seconds()
        self.started = time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def summary(self, torch_version: str) -> dict[str, object]:
        cpu_after, wall = cpu_seconds(), self.elapsed_s()
        # cores kept busy by processes that are not this benchmark's, on average over the benchmark
        others = max(0.0, (cpu_after[0] - self.cpu_before[0]) - (cpu_after[1] - self.cpu_before[1])) / wall
        return {
            "cpu": cpu_name(),
            "cores": CORES,
            "torch": torch_version,
            "load_before": self.load_before,
            "other_processes_cores": others,
            "waited_for_quiet": self.quiet_wait,
            "quiet": self.load_before[0] < 1.0 and others < 0.1,
            "bench_wall_s": wall,
        }
