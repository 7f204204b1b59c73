"""What every benchmark shares: its command line (a bad flag in one line), the machine it runs on, its Markdown
tables, and the one launch helper (bench, bench.scale, bench.choosing, tests/soak.py...): a real script or runner
started as a user does, watched (first record, each rank's peak RSS, a timeout), then what it wrote and, if it
failed, why. No torch here."""

import argparse
import json
import math
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable, NoReturn, Sequence

from common.errors import UserError
from runner.entry import fail

ROOT = Path(__file__).resolve().parent.parent
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
POLL_S = 0.02
RSS_EVERY = 10  # polls between two RSS samples: reading every process's parent costs a few ms


class Parser(argparse.ArgumentParser):
    """A benchmark's command line: a bad flag is a UserError, one line (no usage block), as everywhere in the suite;
    --help shows the defaults."""

    def __init__(self, prog: str, description: str) -> None:
        super().__init__(prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} (see --help)")

    def parse(self, argv: Sequence[str] | None) -> argparse.Namespace:
        """parse_args; a bad flag: one line and exit 2."""
        try:
            return self.parse_args(argv)
        except UserError as e:
            fail(str(e))


def numbers(flag: str, text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything else: one line and exit 2."""
    if not all(n.isdigit() and int(n) > 0 for n in text.split(",")):
        fail(f"{flag}: {text!r}; give positive whole numbers, comma-separated")
    return [int(n) for n in text.split(",")]


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]


def launch_env(nproc: int = 1, **extra: str) -> dict[str, str]:
    """This process's environment for a launch, without what would tie it to a torchrun (threads, rendezvous)."""
    tied = ("OMP_NUM_THREADS", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    ours = {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "PYTHON": sys.executable, "NPROC": str(nproc)}
    return {**{k: v for k, v in os.environ.items() if k not in tied}, **ours, **extra}


def machine_seconds() -> list[float]:
    """The whole machine's CPU seconds since boot by kind: /proc/stat's first line (user, nice, system, idle, iowait,
    irq, softirq, steal, ...)."""
    with open("/proc/stat") as f:
        return [int(v) / os.sysconf("SC_CLK_TCK") for v in f.readline().split()[1:]]


def cpu_seconds() -> tuple[float, float]:
    """(busy CPU seconds of the whole machine, CPU seconds of this process and its waited-for descendants)."""
    seconds, own = machine_seconds(), os.times()
    busy = sum(seconds) - seconds[3] - seconds[4]  # all but idle and iowait
    return busy, own.user + own.system + own.children_user + own.children_system


def stolen_seconds() -> float:
    """CPU seconds the hypervisor gave the machine's cores to other guests since boot (/proc/stat's steal; 0 on
    bare metal): a VM's vCPU taken away for a few ms stalls a peer waiting in every collective."""
    try:
        return machine_seconds()[7]
    except (OSError, IndexError, ValueError):
        return 0.0


def cpu_name() -> str:
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
    """How busy the machine was from a benchmark's start on: timing on a shared machine is noise."""

    def __init__(self, quiet_wait_s: float = 0) -> None:
        deadline = time.time() + quiet_wait_s  # first wait up to quiet_wait_s for a 1-minute load average < 1
        while quiet_wait_s and os.getloadavg()[0] >= 1.0 and time.time() < deadline:
            time.sleep(10)
        self.quiet_wait = os.getloadavg()[0] < 1.0 if quiet_wait_s else None
        self.load_before, self.cpu_before, self.started = os.getloadavg(), cpu_seconds(), time.perf_counter()

    def elapsed_s(self) -> float:
        return time.perf_counter() - self.started

    def other_cores(self, own_s: float | None = None) -> float:
        """Cores others kept busy on average, ours having used `own_s` CPU seconds (default: ours, children's too)."""
        busy, own = cpu_seconds()
        own_s = own - self.cpu_before[1] if own_s is None else own_s
        return max(0.0, busy - self.cpu_before[0] - own_s) / self.elapsed_s()

    def summary(self, torch_version: str) -> dict[str, object]:
        others, load = self.other_cores(), self.load_before
        summary = dict(cpu=cpu_name(), cores=CORES, torch=torch_version, load_before=load, other_processes_cores=others)
        quiet = load[0] < 1.0 and others < 0.1  # the report says when the figures are inflated
        return summary | dict(waited_for_quiet=self.quiet_wait, quiet=quiet, bench_wall_s=self.elapsed_s())


def _sample_rss(root_pid: int, nproc: int, peaks: dict[int, int]) -> None:
    """Record the peak RSS (VmHWM) of each rank (its RANK) among root_pid and every process below it."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:  # "pid (name) state ppid ...": the name may hold spaces
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            pass
    family = {root_pid}
    while more := {pid for pid, parent in parents.items() if parent in family} - family:
        family |= more
    for pid in family:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                rank = next((int(kv[5:]) for kv in f.read().split(b"\0") if kv.startswith(b"RANK=")), None)
        except OSError:
            rank = None
        rank = 0 if rank is None and nproc == 1 and pid == root_pid else rank  # `python train_x.py`: the rank
        if rank is not None and (hwm := peak_rss_bytes(pid)) is not None:
            peaks[rank] = max(peaks.get(rank, 0), hwm)


def records(out: Path, kind: str = "train") -> list[dict[str, Any]]:
    """metrics.jsonl's records of one kind, by step; a line still being written is left out."""
    path, found = out / "metrics.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except ValueError:
            continue
    return sorted((r for r in found if r.get("kind") == kind), key=lambda r: r["step"])


def launch(cmd: list[str], *, out: Path, nproc: int, timeout_s: float, env: dict | None = None) -> dict[str, Any]:
    """Run `cmd` from the suite's root, noting when the first record appears in out/metrics.jsonl and each rank's
    peak RSS. Past `timeout_s` the whole launch is killed."""
    out.mkdir(parents=True, exist_ok=True)
    metrics, peaks, first_record_s, polls = out / "metrics.jsonl", {}, None, 0
    with open(out / "console.log", "w") as console:
        started, stolen = time.perf_counter(), stolen_seconds()
        where = dict(cwd=ROOT, env=env or launch_env(nproc), stdout=console, stderr=subprocess.STDOUT)
        proc = subprocess.Popen(cmd, **where, start_new_session=True)  # a session of its own: killed as one
        while proc.poll() is None and time.perf_counter() - started < timeout_s:
            if first_record_s is None and metrics.exists() and metrics.stat().st_size:
                first_record_s = time.perf_counter() - started
            if polls % RSS_EVERY == 0:
                _sample_rss(proc.pid, nproc, peaks)
            polls += 1
            time.sleep(POLL_S)
        if proc.poll() is None:  # past timeout_s: torchrun (or bash) and its workers
            os.killpg(proc.pid, 9)
            proc.wait()
    wall_s, rss = time.perf_counter() - started, [peaks.get(r) for r in range(nproc)]
    ended = {"returncode": proc.returncode, "wall_s": wall_s, "first_record_s": first_record_s, "peak_rss_bytes": rss}
    return ended | {"stolen_share": (stolen_seconds() - stolen) / (wall_s * CORES)}  # of the cores' time


def failure(out: Path, returncode: int) -> str:
    """The script's own one-line error (or gloo's abort) if it printed one, else the last lines of the console."""
    lines = (out / "console.log").read_text().strip().splitlines()
    pattern = re.compile(r"(?:^|\]:? )((?:\w*Error|error): .*|terminate called.*)")
    said = [m.group(1) for line in lines if "ChildFailedError" not in line and (m := pattern.search(line.strip()))]
    return f"exit {returncode}: {said[0].strip() if said else ' | '.join(lines[-4:])}"


def timing_stats(records: list[dict[str, Any]], *, warmup: int, timed: int | None, batch_size: int) -> dict[str, Any]:
    """samples/s and the step time's distribution over steps warmup + 1 .. warmup + timed (None: to the end)."""
    last = math.inf if timed is None else warmup + timed
    timed_records = [r for r in records if warmup < r["step"] <= last]
    if not timed_records:
        return {}
    times = sorted(r["step_time_s"] for r in timed_records)
    quantile = lambda q: times[round(q * (len(times) - 1))]
    stats = {"timed_steps": len(times), "samples_per_s": batch_size * len(times) / sum(times)}
    spread = dict(p10=quantile(0.1), p90=quantile(0.9), min=times[0], max=times[-1], mean=statistics.fmean(times))
    stats["step_time_s"] = {"median": statistics.median(times), **spread}
    if all("data_time_s" in r for r in timed_records):
        stats["data_share"] = sum(r["data_time_s"] for r in timed_records) / sum(times)
    return stats


def launch_and_read(cmd: list[str], *, out: Path, nproc: int, timeout_s: float, warmup: int, timed: int | None,
                    batch_size: int) -> dict[str, Any]:  # fmt: skip
    """`launch` into a fresh `out`, then what the run wrote: `timing_stats`, its first step's time from the launch
    and, from run.json, the threads, each rank's tensor bytes (and --measure-peak's peak), the test accuracy; on a
    failure, "error": one line."""
    from tools.compare import state_bytes_per_rank

    shutil.rmtree(out, ignore_errors=True)  # a previous launch's: a runner would move it aside
    row = launch(cmd, out=out, nproc=nproc, timeout_s=timeout_s)
    if row["returncode"] != 0:
        return {**row, "error": failure(out, row["returncode"])}
    train = records(out)
    row |= timing_stats(train, warmup=warmup, timed=timed, batch_size=batch_size)
    if train and row["first_record_s"] is not None:
        row["launch_to_first_step_s"] = row["first_record_s"] - train[0]["step_time_s"]
    if (out / "run.json").exists():
        info = json.loads((out / "run.json").read_text())
        row["tensor_bytes_per_rank"] = state_bytes_per_rank(info)
        row["threads_per_process"] = info.get("threads_per_process")
        row["peak_bytes_per_rank"] = [m.get("peak_bytes") for m in info["memory"]["per_rank"]]
        row["test_accuracy"] = (info.get("final") or {}).get("test_accuracy")
    return row


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table's lines; a cell is printed with str()."""
    line = lambda cells: "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)
