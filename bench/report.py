"""The benchmark's arithmetic on its rows (ratios to the baseline and to fp32, achieved FLOP/s, the scaling
table) and bench.md: one function per section, each returning its lines ([] when the report lacks it)."""

from __future__ import annotations

from typing import Any

from bench.breakdown import PARTS

Rows = list[dict[str, Any]]


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _launches(row: dict[str, Any]) -> str:
    each = [v for v in row.get("samples_per_s_of_each_launch", []) if v]
    return f" ({min(each):.0f}–{max(each):.0f} over {len(each)} launches)" if len(each) > 1 else ""


def _round_ratios(row: dict[str, Any]) -> str:
    each = row.get("vs_baseline_each_round")
    return f" ({min(each):.2f}–{max(each):.2f} by round)" if each else ""


def _baseline_speeds(rows: Rows) -> dict[int, float]:
    """Process count -> the baseline's samples/s (its median launch)."""
    return {r["nproc"]: r["samples_per_s"] for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}


def annotate(rows: Rows, *, flops_per_sample: float, peaks: dict[str, float]) -> None:
    """Add achieved GFLOP/s, its fraction of the machine's peak, and the ratio to the baseline (for runs at the
    benchmark's global batch) and of bf16 to its fp32 twin, each also round by round."""
    baseline = _baseline_speeds(rows)
    each_baseline = {r["nproc"]: r.get("samples_per_s_of_each_launch", []) for r in rows if r["strategy"] == "baseline"}
    fp32_twin = {(r["name"], r["nproc"], r["launcher"]): r for r in rows if r["precision"] == "fp32"}
    for row in rows:
        if not row.get("samples_per_s"):
            continue
        row["model_gflops"] = row["samples_per_s"] * flops_per_sample / 1e9
        peak = peaks.get(row["precision"])
        row["peak_fraction"] = row["model_gflops"] / peak if peak else None
        if row["nproc"] in baseline and not row.get("batch_size"):  # a run with its own batch is no rival
            row["vs_baseline"] = row["samples_per_s"] / baseline[row["nproc"]]
            rounds = zip(row.get("samples_per_s_of_each_launch", []), each_baseline.get(row["nproc"], []))
            ratios = [a / b for a, b in rounds if a and b]
            if len(ratios) > 1 and row["strategy"] != "baseline":
                row["vs_baseline_each_round"] = ratios
        twin = fp32_twin.get((row["name"], row["nproc"], row["launcher"]))
        if row["precision"] == "bf16" and twin and twin.get("samples_per_s"):  # the bf16 speed-up, side by side
            row["vs_fp32"] = row["samples_per_s"] / twin["samples_per_s"]
            rounds = zip(row.get("samples_per_s_of_each_launch", []), twin.get("samples_per_s_of_each_launch", []))
            row["vs_fp32_each_round"] = [a / b for a, b in rounds if a and b]


def scaling_table(rows: Rows) -> dict[str, dict[str, float]]:
    """Run name -> process count -> fp32 samples/s, for the runs at the benchmark's batch and threads that ran
    on more than one process count."""
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        own_settings = r.get("batch_size") or r.get("threads")
        if r.get("ok") and r["precision"] == "fp32" and r.get("samples_per_s") and not own_settings:
            table.setdefault(r["name"], {})[str(r["nproc"])] = r["samples_per_s"]
    return {k: v for k, v in table.items() if len(v) > 1}


def markdown(report: dict[str, Any]) -> str:
    sections = [
        _machine_lines,
        _settings_lines,
        _runs_table,
        _bf16_lines,
        _scaling_lines,
        _ceiling_lines,
        _breakdown_lines,
        _data_wait_lines,
        _fast_path_lines,
        _conv_lines,
        _profile_lines,
        _imports_lines,
    ]
    return "\n".join(line for section in sections for line in section(report)) + "\n"


def _machine_lines(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average (1 min) before: "
        f"{m['load_before'][0]:.2f}; other processes used {m['other_processes_cores']:.2f} cores on average "
        f"during the {m['bench_wall_s']:.0f} s run"
        + ("" if m["quiet"] else " -- **not quiet: other work shared the cores, the figures are inflated**")
        + "."
    ]


def _settings_lines(report: dict[str, Any]) -> list[str]:
    s = report["settings"]
    return [
        "",
        f"Global batch {s['batch_size']}; {s['warmup_steps']} warm-up steps, then {s['timed_steps']} timed "
        f"(the full run: all steps after the warm-up). Matmul peak ({s['peak_n']}^3, best of "
        f"{s['peak_repeats']}): "
        + ", ".join(f"{k} {v:.0f}" for k, v in report["peak_by_threads_gflops"].items())
        + " GFLOP/s; a run's % of peak is of the all-cores figure in its dtype"
        + f". Model: {report['model']['train_flops_per_sample'] / 1e6:.1f} MFLOP per sample (forward + backward).",
    ]


def _runs_table(report: dict[str, Any]) -> list[str]:
    return [
        "",
        "| run | precision | procs | samples/s | × baseline | step ms: median (p10–p90) | launch → 1st step s "
        "| tensors/rank MiB | peak RSS/rank MiB | GFLOP/s | % of peak | test acc |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *(_run_row(r) for r in report["runs"]),
    ]


def _run_row(r: dict[str, Any]) -> str:
    if not r.get("ok"):
        return f"| {r['name']} | {r['precision']} | {r['nproc']} | failed: {r.get('error', '')[:120]} | | | | | | | | |"
    st = r.get("step_time_s")
    step_ms = f"{1e3 * st['median']:.1f} ({1e3 * st['p10']:.0f}–{1e3 * st['p90']:.0f})" if st else "-"
    name = r["name"]
    if r["launcher"] == "run_ddp.sh":
        name += " (`run_ddp.sh`" + (", full run)" if r["full"] else ")")
    rss = [v for v in r.get("peak_rss_bytes", []) if v]
    tensors = r.get("tensor_bytes_per_rank") or []
    return (
        f"| {name} | {r['precision']} | {r['nproc']} | {_fmt(r.get('samples_per_s'), '.0f')}{_launches(r)} | "
        f"{_fmt(r.get('vs_baseline'), '.2f')}{_round_ratios(r)} | {step_ms} | "
        f"{_fmt(r.get('launch_to_first_step_s'), '.1f')} | {_mib(max(tensors)) if tensors else '-'} | "
        f"{_mib(max(rss)) if rss else '-'} | {_fmt(r.get('model_gflops'), '.1f')} | "
        f"{_fmt(100 * r['peak_fraction'] if r.get('peak_fraction') else None, '.1f')} | "
        f"{_fmt(100 * r['test_accuracy'] if r.get('test_accuracy') is not None else None, '.2f')} |"
    )


def _bf16_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in report["runs"]:
        if not r.get("vs_fp32"):
            continue
        each = r.get("vs_fp32_each_round") or []
        where = f"{r['name']} on {r['nproc']} process{'es' if r['nproc'] > 1 else ''}"
        if len(each) > 1:
            said = (
                f"bf16 against fp32, {where}, launched in the same rounds: {r['vs_fp32']:.2f}× (median "
                f"launches), {min(each):.2f}–{max(each):.2f}× by round."
            )
        else:
            said = f"bf16 against fp32, {where}: {r['vs_fp32']:.2f}× (one bf16 launch against the fp32 row)."
        lines += ["", said]
    return lines


def _scaling_lines(report: dict[str, Any]) -> list[str]:
    scaling = report.get("scaling")
    if not scaling:
        return []
    procs = sorted({p for row in scaling.values() for p in row}, key=int)
    lines = [
        "",
        "Scaling, fp32 samples/s (× the same run on 1 process):",
        "",
        "| run | " + " | ".join(f"{p} proc" for p in procs) + " |",
        "|---|" + "---|" * len(procs),
    ]
    for name, row in scaling.items():
        one = row.get("1")
        cells = [
            ("-" if row.get(p) is None else f"{row[p]:.0f}" + (f" ({row[p] / one:.2f}×)" if one else "")) for p in procs
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _ceiling_lines(report: dict[str, Any]) -> list[str]:
    """The 1F1B pipeline rows against what one thread per rank allows them (pipeline_ceiling)."""
    ceiling, rows = report.get("pipeline_ceiling") or {}, report["runs"]
    baseline = _baseline_speeds(rows)
    pipelines = [
        r
        for r in rows
        if r.get("ok")
        and r.get("pipeline", {}).get("schedule") == "1f1b"
        and r["precision"] == "fp32"
        and r.get("samples_per_s")
    ]
    if not ceiling or not pipelines:
        return []
    peak = report["peak_by_threads_gflops"]["fp32 1 thread, CPU time"]
    lines = [
        "",
        f"The pipeline's ceiling with one thread per rank: every sample passes through the heaviest "
        f"stage, on one core, at best at the 1-thread fp32 matmul peak ({peak:.0f} GFLOP/s, CPU time), "
        "counting only conv and linear FLOPs (× the replicas, each on a core of its own):",
        "",
        "| run | procs | heaviest stage | MFLOP per sample | ceiling samples/s | measured | baseline |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in pipelines:
        layout = r["pipeline"]  # as the run's run.json reports it
        c = ceiling.get(str(layout["stages"]))
        if not c:
            continue
        bound = c["samples_per_s"] * min(layout["replicas"], report["machine"]["cores"])
        lines.append(
            f"| {r['name']} | {r['nproc']} | {', '.join(c['heaviest_stage'])} | "
            f"{c['train_flops_per_sample'] / 1e6:.1f} | {bound:.0f} | {r['samples_per_s']:.0f} | "
            f"{_fmt(baseline.get(r['nproc']), '.0f')} |"
        )
    return lines


def _breakdown_lines(report: dict[str, Any]) -> list[str]:
    breakdowns = report.get("step_breakdown")
    if not breakdowns:
        return []
    lines = [
        "",
        "Where a step goes (profiler spans of a real `train_ddp.py` run): each part's share of the step time, "
        "and its median ms:",
        "",
        "| per-process batch | threads | step ms | " + " | ".join(PARTS) + " | other |",
        "|---|---|---|" + "---|" * (len(PARTS) + 1),
    ]
    for b in breakdowns:
        if "error" in b:
            lines.append(f"| {b['batch_size']} | {b['threads']} | failed: {b['error'][:120]} |" + " |" * len(PARTS))
            continue
        ms, share = b["median_ms"], b["share"]
        cells = [f"{100 * share[part]:.1f}% ({ms[part]:.2f})" for part in (*PARTS, "other")]
        lines.append(f"| {b['batch_size']} | {b['threads']} | {ms['step']:.1f} | " + " | ".join(cells) + " |")
    first = breakdowns[0]
    unprofiled = " and ".join(_fmt(b.get("timed_step_ms"), ".1f") for b in breakdowns)
    runs = "runs'" if len(breakdowns) > 1 else "run's"
    lines += [
        "",
        f"Steps profiled after the timed ones (`--profile-steps`, e.g. {':'.join(map(str, first['profiled_steps']))}"
        "), the first left out (the profiler's start-up). The profiler adds time to every op: the same "
        f"{runs} timed steps, unprofiled, took {unprofiled} ms (median). "
        "other: setting the learning rate, zero_grad, gradient clipping and the loss all-reduce. Each run's "
        "command and trace: bench.json `step_breakdown`.",
    ]
    return lines


def _data_wait_lines(report: dict[str, Any]) -> list[str]:
    base = [r for r in report["runs"] if r["strategy"] == "baseline" and r.get("data_share") is not None]
    if not base:
        return []
    waits = ", ".join(f"{r['nproc']} proc {100 * r['data_share']:.0f}%" for r in base)
    return ["", f"The baseline's DataLoader wait, share of its step time: {waits}."]


def _fast_path_lines(report: dict[str, Any]) -> list[str]:
    lines = []
    for fast in report.get("fast_paths", []):
        one = fast["threads"] == 1
        lines += [
            "",
            f"Fast paths on one process's step (batch {fast['batch_size']}, {fast['threads']} thread"
            f"{'' if one else 's'}, {fast['clock']}, interleaved rounds):",
            "",
            "| variant | samples/s | × fp32 | GFLOP/s | % of its dtype's peak | page faults/step |",
            "|---|---|---|---|---|---|",
        ]
        for name, v in fast["variants"].items():
            dtype = "bf16" if "bf16" in name else "fp32"
            peaks = report["peak_by_threads_gflops"]
            peak = peaks[f"{dtype} 1 thread, CPU time"] if one else report["peak_gflops"][dtype]
            gflops = v["samples_per_s"] * report["model"]["train_flops_per_sample"] / 1e9
            lines.append(
                f"| {name} | {v['samples_per_s']:.0f} | {v['vs_first']:.2f} | {gflops:.1f} | "
                f"{100 * gflops / peak:.1f}% | {v.get('page_faults_per_step', 0):.0f} |"
            )
    return lines


def _conv_lines(report: dict[str, Any]) -> list[str]:
    conv = report.get("conv_diagnosis")
    if not conv:
        return []
    return [
        "",
        "conv2 (128×32×26×26, 3×3, forward + backward) in oneDNN (ONEDNN_VERBOSE; ms are one "
        "iteration's, single-shot):",
        "",
        "| dtype, layout | conv kernels | conv ms | reorder ms |",
        "|---|---|---|---|",
        *(
            f"| {name} | {', '.join(sorted(set(v['conv_kernels'])))} | {v['conv_ms']:.1f} | {v['reorder_ms']:.1f} |"
            for name, v in conv.items()
        ),
    ]


def _profile_lines(report: dict[str, Any]) -> list[str]:
    prof = report.get("profile")
    if not prof:
        return []
    return [
        "",
        f"Profile of the single-process fp32 step ({prof['variant']}, batch {prof['batch_size']}, "
        f"{prof['threads']} threads; torch.profiler self CPU time, {prof['self_cpu_ms_per_step']:.1f} ms/step):",
        "",
        "| op group | ms/step | share |",
        "|---|---|---|",
        *(f"| {group} | {g['ms_per_step']:.1f} | {100 * g['share']:.1f}% |" for group, g in prof["groups"].items()),
    ]


def _imports_lines(report: dict[str, Any]) -> list[str]:
    imports = report.get("imports")
    if not imports:
        return []
    yes_no = lambda flag: "yes" if flag else "no"
    slowest = ", ".join(f"{k} {v:.2f} s" for k, v in imports["top_level_import_s"].items())
    return [
        "",
        f"Imports of `python train_ddp.py` (default data set, `-X importtime`): torchvision imported: "
        f"{yes_no(imports['torchvision_imported'])}; PIL: {yes_no(imports['PIL_imported'])}; "
        f"slowest top-level imports: {slowest}.",
    ]
