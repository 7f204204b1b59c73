"""Launching the real scripts and reading what they wrote: each run as a user starts it (`python train_x.py`,
torchrun, `bash run_ddp.sh`), watched for its first metrics record and each rank's peak RSS; its samples/s and
step times from its own metrics.jsonl, its memory and layout from its run.json, and, for a run that profiles
steps after its timed ones, where those steps went (bench/breakdown.py)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Sequence

from bench.breakdown import trace_breakdown
from bench.machine import ROOT, launch_env
from bench.plan import RunSpec, Settings
from tools.compare import state_bytes_per_rank


def _process_table() -> dict[int, int]:
    """pid -> parent pid, for every process."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return parents


def _sample_rss(root_pid: int, nproc: int, peaks: dict[int, int]) -> None:
    """Record the peak RSS (VmHWM) of each rank among root_pid's descendants, keyed by rank."""
    parents = _process_table()
    family, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        for child, parent in parents.items():
            if parent == pid and child not in family:
                family.add(child)
                frontier.append(child)
    for pid in family:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
            with open(f"/proc/{pid}/status") as f:
                hwm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))
        except (OSError, StopIteration, ValueError):
            continue
        rank = int(environ[b"RANK"]) if b"RANK" in environ else (0 if nproc == 1 and pid == root_pid else None)
        if rank is not None:
            peaks[rank] = max(peaks.get(rank, 0), hwm)


def _has_eval_at(metrics: Path, step: int) -> bool:
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:  # the line being written
            continue
        if record.get("kind") == "eval" and record.get("step") == step:
            return True
    return False


def launch_and_watch(
    cmd: list[str], *, out: Path, nproc: int, timeout_s: float, rss_until_eval_at: int | None = None
) -> dict[str, Any]:
    """Run `cmd`, noting when the first record appears in out/metrics.jsonl and each rank's peak RSS: to the
    end, or up to the evaluation record of step `rss_until_eval_at` (a run that profiles steps after it: the
    profiler's buffers are not the run's memory)."""
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    peaks: dict[int, int] = {}
    with open(out / "console.log", "w") as console:
        started = time.perf_counter()
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=launch_env(nproc), stdout=console, stderr=subprocess.STDOUT, start_new_session=True
        )
        first_record_s, polls, watching_rss, size = None, 0, True, 0
        while proc.poll() is None:
            if first_record_s is None and metrics.exists() and metrics.stat().st_size > 0:
                first_record_s = time.perf_counter() - started
            if watching_rss and polls % 10 == 0:
                _sample_rss(proc.pid, nproc, peaks)
            if watching_rss and rss_until_eval_at and metrics.exists() and metrics.stat().st_size != size:
                size = metrics.stat().st_size  # read the records again only when there are new ones
                if _has_eval_at(metrics, rss_until_eval_at):
                    _sample_rss(proc.pid, nproc, peaks)  # the last sample, within a poll (20 ms) of the record
                    watching_rss = False
            polls += 1
            if time.perf_counter() - started > timeout_s:
                os.killpg(proc.pid, 9)  # the whole session we started: torchrun and its workers
                proc.wait()
                break
            time.sleep(0.02)
        wall_s = time.perf_counter() - started
    return {
        "returncode": proc.returncode,
        "wall_s": wall_s,
        "first_record_s": first_record_s,
        "peak_rss_bytes": [peaks.get(r) for r in range(nproc)],
    }


def read_train_records(out: Path) -> list[dict[str, Any]]:
    path = out / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r["kind"] == "train"), key=lambda r: r["step"])


def timing_stats(records: list[dict[str, Any]], *, warmup: int, timed: int | None, batch_size: int) -> dict[str, Any]:
    """Throughput and step-time distribution over steps warmup + 1 .. warmup + timed (timed None: all the
    steps after the warm-up). Steps after them (profiled ones) are left out."""
    last = math.inf if timed is None else warmup + timed
    timed_records = [r for r in records if warmup < r["step"] <= last]
    if not timed_records:
        return {}
    times = sorted(r["step_time_s"] for r in timed_records)

    def quantile(q: float) -> float:
        return times[min(len(times) - 1, max(0, round(q * (len(times) - 1))))]

    stats = {
        "timed_steps": len(timed_records),
        "samples_per_s": batch_size * len(timed_records) / sum(times),
        "step_time_s": {
            "median": statistics.median(times),
            "p10": quantile(0.1),
            "p90": quantile(0.9),
            "min": times[0],
            "max": times[-1],
            "mean": statistics.fmean(times),
        },
    }
    if all("data_time_s" in r for r in timed_records):
        stats["data_share"] = sum(r["data_time_s"] for r in timed_records) / sum(times)
    return stats


def _failure(out: Path, returncode: int) -> str:
    """The script's own one-line error if it printed one, else the last lines of the console."""
    lines = (out / "console.log").read_text().strip().splitlines()
    said = [
        m.group(1)
        for line in lines
        if (m := re.search(r"(?:^|\]:? )((?:\w*Error|error): .*)", line.strip())) and "ChildFailedError" not in line
    ]
    why = said[0].strip() if said else " | ".join(lines[-4:])
    return f"exit {returncode}: {why}"


def run_json_facts(info: dict[str, Any]) -> dict[str, Any]:
    """What a row takes from the run's run.json: threads, each rank's tensor bytes, test accuracy, and a
    pipeline's layout (replicas and pipeline ranks, as the run itself reports them) and measured bubble."""
    facts = {
        "threads_per_process": info.get("threads_per_process"),
        "tensor_bytes_per_rank": state_bytes_per_rank(info),
        "test_accuracy": (info.get("final") or {}).get("test_accuracy"),
    }
    pipeline = info.get("pipeline")
    if pipeline:
        facts["pipeline"] = {
            "schedule": info["config"]["schedule"],
            "replicas": info["config"]["dp"],
            "pipeline_ranks": pipeline["pp_size"],
            "stages": pipeline["n_stages"],
        }
        bubble = pipeline.get("bubble")
        if bubble:  # the pipeline's own measurement: how busy each rank was
            facts["pipeline_bubble"] = {
                "measured": bubble.get("measured"),
                "busy_fraction_per_rank": bubble.get("busy_fraction_per_rank"),
            }
    return facts


def _breakdown(spec: RunSpec, row: dict[str, Any], out: Path, s: Settings) -> dict[str, Any]:
    """The step breakdown of a run that profiled steps after its timed ones, from rank 0's trace."""
    about = {
        "run": spec.name,
        "command": row["command"],
        "batch_size": spec.global_batch(s) // spec.nproc,  # per process
        "threads": row.get("threads_per_process"),
        "precision": spec.precision,
        "profiled_steps": list(spec.profiled(s) or ()),
        # the same run's timed steps, which ran without the profiler: what the profiler's own cost adds up to
        "timed_step_ms": 1e3 * row["step_time_s"]["median"] if row.get("step_time_s") else None,
    }
    try:
        return {**about, **trace_breakdown(out / "traces" / "rank0.json")}
    except (OSError, KeyError, ValueError) as error:  # a measurement missing, not a benchmark stopped
        return {**about, "error": f"{type(error).__name__}: {error}"}


def run_one(spec: RunSpec, s: Settings, *, work: Path, timeout_s: float, attempt: int = 0) -> dict[str, Any]:
    """Launch `spec` once, into work/<its folder>, and return its row."""
    name = spec.folder + (f"_launch{attempt}" if attempt else "")
    out = work / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
    shutil.rmtree(out, ignore_errors=True)
    row: dict[str, Any] = {**asdict(spec), "out": str(out)}
    if spec.script and not (ROOT / spec.script).exists():
        return {**row, "ok": False, "error": f"{spec.script} does not exist (yet)"}
    cmd = spec.command(s, out)
    row["command"] = " ".join(cmd).replace(sys.executable, "python")
    profiled = spec.profiled(s)
    rss_until = profiled[0] - 1 if profiled else None  # the evaluation before the profiled steps (RunSpec.flags)
    watched = launch_and_watch(cmd, out=out, nproc=spec.nproc, timeout_s=timeout_s, rss_until_eval_at=rss_until)
    row.update(watched)
    if watched["returncode"] != 0:
        return {**row, "ok": False, "error": _failure(out, watched["returncode"])}
    row["ok"] = True
    records = read_train_records(out)
    timed = None if spec.full else s.timed  # the full run: every step after the warm-up
    row.update(timing_stats(records, warmup=s.warmup, timed=timed, batch_size=spec.global_batch(s)))
    if records and watched["first_record_s"] is not None:
        row["launch_to_first_step_s"] = watched["first_record_s"] - records[0]["step_time_s"]
    if (out / "run.json").exists():
        row.update(run_json_facts(json.loads((out / "run.json").read_text())))
    if spec.profile_steps:
        row["step_breakdown"] = _breakdown(spec, row, out, s)
    return row


def launch_all(
    plan: Sequence[RunSpec], s: Settings, *, work: Path, repeats: int, timeout_s: float, say: Callable[[str], None]
) -> list[dict[str, Any]]:
    """One row per run of `plan`, in its order. The runs the acceptance compares (`scaling`) are launched
    `repeats` times, in rounds (every one of them once, then again): a launch's speed moves by 5-10 % with the
    machine's state and the allocator's history, and rounds let that noise hit the baseline and the
    strategies alike. Each such row is its median launch, with every launch's samples/s in round order."""
    order = [(i, spec) for i in range(repeats) for spec in plan if spec.scaling]
    order += [(0, spec) for spec in plan if not spec.scaling]
    launches: dict[int, list[dict[str, Any]]] = {id(spec): [] for spec in plan}
    for i, spec in order:
        rounds = f", round {i + 1} of {repeats}" if spec.scaling and repeats > 1 else ""
        say(f"{spec.name} {spec.precision} x{spec.nproc} ({spec.launcher}){rounds}")
        launch = run_one(spec, s, work=work, timeout_s=timeout_s, attempt=i)
        if not launch["ok"]:
            say(f"  failed: {launch['error']}")
        else:
            median_ms = 1e3 * launch.get("step_time_s", {}).get("median", 0)
            say(f"  {launch.get('samples_per_s', 0):.0f} samples/s, median step {median_ms:.1f} ms")
        launches[id(spec)].append(launch)
    rows = []
    for spec in plan:
        attempts = launches[id(spec)]
        done = sorted((a for a in attempts if a["ok"]), key=lambda a: a["samples_per_s"])
        row = done[len(done) // 2] if done else attempts[0]
        if len(attempts) > 1:  # in round order
            row["samples_per_s_of_each_launch"] = [a.get("samples_per_s") for a in attempts]
        rows.append(row)
    return rows
