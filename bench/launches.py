"""The one launch helper of python -m bench, bench.scale, bench.essentials and tests/soak.py: start a real script or
runner as a user does (`python train_x.py`, torchrun, `bash run_x.sh`), its output in <out>/console.log, watched
for its first metrics record and each rank's peak RSS, killed past its timeout; then read what it wrote
(metrics.jsonl, run.json) and, if it failed, why."""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.machine import ROOT, launch_env, peak_rss_bytes

POLL_S = 0.02
RSS_EVERY = 10  # polls between two RSS samples: reading every process's parent costs a few ms


def _descendants(root_pid: int) -> set[int]:
    """root_pid and every process below it."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as f:
                parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            pass
    family, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = {child for child, parent in parents.items() if parent == pid} - family
        family |= children
        frontier += children
    return family


def _rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return None
    return int(environ[b"RANK"]) if b"RANK" in environ else None


def _sample_rss(root_pid: int, nproc: int, peaks: dict[int, int]) -> None:
    """Record the peak RSS (VmHWM) of each rank among root_pid's descendants, keyed by rank."""
    for pid in _descendants(root_pid):
        rank = _rank_of(pid)
        if rank is None and nproc == 1 and pid == root_pid:  # `python train_x.py`: the process is the rank
            rank = 0
        hwm = peak_rss_bytes(pid) if rank is not None else None
        if hwm is not None:
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


def read_run_json(out: Path) -> dict[str, Any] | None:
    path = out / "run.json"
    return json.loads(path.read_text()) if path.exists() else None


def launch(
    cmd: list[str],
    *,
    out: Path,
    nproc: int,
    timeout_s: float,
    rss_until_eval_at: int | None = None,
    env: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Run `cmd` from the suite's root, noting when the first record appears in out/metrics.jsonl and each rank's
    peak RSS: to the end, or up to the evaluation record of step `rss_until_eval_at` (a run that profiles steps
    after it: the profiler's buffers are not the run's memory). Past `timeout_s` the whole launch is killed."""
    out.mkdir(parents=True, exist_ok=True)
    metrics, peaks = out / "metrics.jsonl", {}
    first_record_s, polls, watching_rss, size = None, 0, True, 0
    with open(out / "console.log", "w") as console:
        started = time.perf_counter()
        where = dict(cwd=ROOT, env=env or launch_env(nproc), stdout=console, stderr=subprocess.STDOUT)
        proc = subprocess.Popen(cmd, **where, start_new_session=True)  # a session of its own: killed as one
        while proc.poll() is None:
            grown = metrics.exists() and metrics.stat().st_size != size
            if first_record_s is None and grown:
                first_record_s = time.perf_counter() - started
            if watching_rss and polls % RSS_EVERY == 0:
                _sample_rss(proc.pid, nproc, peaks)
            if watching_rss and rss_until_eval_at and grown:
                size = metrics.stat().st_size  # read the records again only when there are new ones
                if any(r["step"] == rss_until_eval_at for r in records(out, "eval")):
                    _sample_rss(proc.pid, nproc, peaks)  # the last sample, within a poll of the record
                    watching_rss = False
            polls += 1
            if time.perf_counter() - started > timeout_s:
                os.killpg(proc.pid, 9)  # torchrun (or bash) and its workers
                proc.wait()
                break
            time.sleep(POLL_S)
    return {
        "returncode": proc.returncode,
        "wall_s": time.perf_counter() - started,
        "first_record_s": first_record_s,
        "peak_rss_bytes": [peaks.get(r) for r in range(nproc)],
    }


def failure(out: Path, returncode: int) -> str:
    """The script's own one-line error (or gloo's abort) if it printed one, else the last lines of the console."""
    lines = (out / "console.log").read_text().strip().splitlines()
    said = [
        m.group(1)
        for line in lines
        if (m := re.search(r"(?:^|\]:? )((?:\w*Error|error): .*|terminate called.*)", line.strip()))
        and "ChildFailedError" not in line
    ]
    return f"exit {returncode}: {said[0].strip() if said else ' | '.join(lines[-4:])}"


def timing_stats(records: list[dict[str, Any]], *, warmup: int, timed: int | None, batch_size: int) -> dict[str, Any]:
    """Throughput and step-time distribution over steps warmup + 1 .. warmup + timed (timed None: all the
    steps after the warm-up). Steps after them (profiled ones) are left out."""
    last = math.inf if timed is None else warmup + timed
    timed_records = [r for r in records if warmup < r["step"] <= last]
    if not timed_records:
        return {}
    times = sorted(r["step_time_s"] for r in timed_records)
    quantile = lambda q: times[round(q * (len(times) - 1))]
    step_time = dict(median=statistics.median(times), p10=quantile(0.1), p90=quantile(0.9), min=times[0], max=times[-1])
    stats = {"timed_steps": len(times), "samples_per_s": batch_size * len(times) / sum(times)}
    stats["step_time_s"] = {**step_time, "mean": statistics.fmean(times)}
    if all("data_time_s" in r for r in timed_records):
        stats["data_share"] = sum(r["data_time_s"] for r in timed_records) / sum(times)
    return stats


def run_json_facts(info: dict[str, Any]) -> dict[str, Any]:
    """What a row takes from the run's run.json: threads, each rank's tensor bytes, test accuracy, and a
    pipeline's layout (replicas and pipeline ranks, as the run itself reports them) and measured bubble."""
    from tools.compare import state_bytes_per_rank

    facts = {
        "threads_per_process": info.get("threads_per_process"),
        "tensor_bytes_per_rank": state_bytes_per_rank(info),
        "test_accuracy": (info.get("final") or {}).get("test_accuracy"),
    }
    pipeline = info.get("pipeline")
    if pipeline:
        config = info["config"]
        layout = dict(schedule=config["schedule"], replicas=config["dp"], pipeline_ranks=pipeline["pp_size"])
        facts["pipeline"] = {**layout, "stages": pipeline["n_stages"]}
        bubble = pipeline.get("bubble")
        if bubble:  # the pipeline's own measurement: how busy each rank was
            facts["pipeline_bubble"] = {k: bubble.get(k) for k in ("measured", "busy_fraction_per_rank")}
    return facts
