"""The benchmark's arithmetic on its rows (ratios to the baseline and to fp32, achieved FLOP/s, the scaling
table) and bench.md: one function per section, each returning its lines ([] when the report lacks it). No torch."""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from bench.breakdown import PARTS

Rows = list[dict[str, Any]]


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table's lines; a cell is printed with str()."""
    line = lambda cells: "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def _fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def _spread(values: Sequence[float] | None, spec: str, what: str) -> str:
    """' (min–max what)' of several values (`what` may name their number, {n}), else ''."""
    values = [v for v in values or [] if v]
    return f" ({min(values):{spec}}–{max(values):{spec}}{what.format(n=len(values))})" if len(values) > 1 else ""


def _baseline_speeds(rows: Rows) -> dict[int, float]:
    """Process count -> the baseline's samples/s (its median launch)."""
    return {r["nproc"]: r["samples_per_s"] for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}


def _round_ratios(row: dict[str, Any], other: dict[str, Any]) -> list[float]:
    rounds = zip(row.get("samples_per_s_of_each_launch", []), other.get("samples_per_s_of_each_launch", []))
    return [a / b for a, b in rounds if a and b]


def annotate(rows: Rows, *, flops_per_sample: float, peaks: dict[str, float]) -> None:
    """Add achieved GFLOP/s, its fraction of the machine's peak, and the ratio to the baseline (for runs at the
    benchmark's global batch) and of bf16 to its fp32 twin, each also round by round."""
    baseline = {r["nproc"]: r for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}
    fp32_twin = {(r["name"], r["nproc"], r["launcher"]): r for r in rows if r["precision"] == "fp32"}
    for row in rows:
        if not row.get("samples_per_s"):
            continue
        row["model_gflops"] = row["samples_per_s"] * flops_per_sample / 1e9
        peak = peaks.get(row["precision"])
        row["peak_fraction"] = row["model_gflops"] / peak if peak else None
        rival = baseline.get(row["nproc"])
        if rival and not row.get("batch_size"):  # a run with its own batch is no rival
            row["vs_baseline"] = row["samples_per_s"] / rival["samples_per_s"]
            ratios = _round_ratios(row, rival)
            if len(ratios) > 1 and row["strategy"] != "baseline":
                row["vs_baseline_each_round"] = ratios
        twin = fp32_twin.get((row["name"], row["nproc"], row["launcher"]))
        if row["precision"] == "bf16" and twin and twin.get("samples_per_s"):  # the bf16 speed-up, side by side
            row["vs_fp32"] = row["samples_per_s"] / twin["samples_per_s"]
            row["vs_fp32_each_round"] = _round_ratios(row, twin)


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
    sections = [_machine, _settings, _runs, _bf16, _scaling, _ceiling, _breakdown, _data_wait, _fast_paths, _conv]
    return "\n".join(line for section in [*sections, _profile, _imports] for line in section(report)) + "\n"


def _section(*paragraphs: str | list[str]) -> list[str]:
    """The lines of a section: each paragraph (a line, or a table's lines) after an empty line."""
    return [line for p in paragraphs for line in ["", *([p] if isinstance(p, str) else p)]]


def _machine(report: dict[str, Any]) -> list[str]:
    m = report["machine"]
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average (1 min) before: "
        f"{m['load_before'][0]:.2f}; other processes used {m['other_processes_cores']:.2f} cores on average "
        f"during the {m['bench_wall_s']:.0f} s run"
        + ("" if m["quiet"] else " -- **not quiet: other work shared the cores, the figures are inflated**")
        + "."
    ]


def _settings(report: dict[str, Any]) -> list[str]:
    s, peaks = report["settings"], ", ".join(f"{k} {v:.0f}" for k, v in report["peak_by_threads_gflops"].items())
    return _section(
        f"Global batch {s['batch_size']}; {s['warmup_steps']} warm-up steps, then {s['timed_steps']} timed (the full "
        f"run: all steps after the warm-up). Matmul peak ({s['peak_n']}^3, best of {s['peak_repeats']}): {peaks} "
        "GFLOP/s; a run's % of peak is of the all-cores figure in its dtype. Model: "
        f"{report['model']['train_flops_per_sample'] / 1e6:.1f} MFLOP per sample (forward + backward)."
    )


RUN_COLUMNS = ["run", "precision", "procs", "samples/s", "× baseline", "step ms: median (p10–p90)"]
RUN_COLUMNS += ["launch → 1st step s", "tensors/rank MiB", "peak RSS/rank MiB", "GFLOP/s", "% of peak", "test acc"]


def _runs(report: dict[str, Any]) -> list[str]:
    return _section(md_table(RUN_COLUMNS, map(_run_cells, report["runs"])))


def _run_cells(r: dict[str, Any]) -> list[str]:
    if not r.get("ok"):
        return [r["name"], r["precision"], r["nproc"], f"failed: {r.get('error', '')[:120]}", *[""] * 8]
    st = r.get("step_time_s")
    step_ms = f"{1e3 * st['median']:.1f} ({1e3 * st['p10']:.0f}–{1e3 * st['p90']:.0f})" if st else "-"
    runner = " (`run_ddp.sh`" + (", full run)" if r["full"] else ")") if r["launcher"] == "run_ddp.sh" else ""
    rss, tensors = [v for v in r.get("peak_rss_bytes", []) if v], r.get("tensor_bytes_per_rank") or []
    samples = _spread(r.get("samples_per_s_of_each_launch"), ".0f", " over {n} launches")
    by_round = _spread(r.get("vs_baseline_each_round"), ".2f", " by round")
    return [
        *(r["name"] + runner, r["precision"], r["nproc"]),
        *(_fmt(r.get("samples_per_s"), ".0f") + samples, _fmt(r.get("vs_baseline"), ".2f") + by_round, step_ms),
        *(_fmt(r.get("launch_to_first_step_s"), ".1f"), _fmt(max(tensors, default=None), ".0f", 2**-20)),
        *(_fmt(max(rss, default=None), ".0f", 2**-20), _fmt(r.get("model_gflops"), ".1f")),
        *(_fmt(r.get("peak_fraction") or None, ".1f", 100), _fmt(r.get("test_accuracy"), ".2f", 100)),
    ]


def _bf16(report: dict[str, Any]) -> list[str]:
    lines = []
    for r in (r for r in report["runs"] if r.get("vs_fp32")):
        each = r.get("vs_fp32_each_round") or []
        where = f"bf16 against fp32, {r['name']} on {r['nproc']} process{'es' if r['nproc'] > 1 else ''}"
        if len(each) > 1:
            rounds = f"{min(each):.2f}–{max(each):.2f}× by round"
            lines += _section(f"{where}, launched in the same rounds: {r['vs_fp32']:.2f}× (median launches), {rounds}.")
        else:
            lines += _section(f"{where}: {r['vs_fp32']:.2f}× (one bf16 launch against the fp32 row).")
    return lines


def _scaling(report: dict[str, Any]) -> list[str]:
    scaling = report.get("scaling")
    if not scaling:
        return []
    procs = sorted({p for row in scaling.values() for p in row}, key=int)
    cell = lambda v, one: "-" if v is None else f"{v:.0f}" + (f" ({v / one:.2f}×)" if one else "")
    rows = ([name, *(cell(row.get(p), row.get("1")) for p in procs)] for name, row in scaling.items())
    table = md_table(["run", *(f"{p} proc" for p in procs)], rows)
    return _section("Scaling, fp32 samples/s (× the same run on 1 process):", table)


def _ceiling(report: dict[str, Any]) -> list[str]:
    """The 1F1B pipeline rows against what one thread per rank allows them (pipeline_ceiling)."""
    ceiling, baseline = report.get("pipeline_ceiling") or {}, _baseline_speeds(report["runs"])
    rows = []
    for r in report["runs"]:
        layout = r.get("pipeline", {})  # as the run's run.json reports it
        c = ceiling.get(str(layout.get("stages")))
        if c and r.get("ok") and layout["schedule"] == "1f1b" and r["precision"] == "fp32" and r.get("samples_per_s"):
            bound = c["samples_per_s"] * min(layout["replicas"], report["machine"]["cores"])
            rows.append(
                [r["name"], r["nproc"], ", ".join(c["heaviest_stage"]), f"{c['train_flops_per_sample'] / 1e6:.1f}"]
                + [f"{bound:.0f}", f"{r['samples_per_s']:.0f}", _fmt(baseline.get(r["nproc"]), ".0f")]
            )
    peak = report["peak_by_threads_gflops"]["fp32 1 thread, CPU time"]
    header = ["run", "procs", "heaviest stage", "MFLOP per sample", "ceiling samples/s", "measured", "baseline"]
    intro = (
        "The pipeline's ceiling with one thread per rank: every sample passes through the heaviest stage, on one "
        f"core, at best at the 1-thread fp32 matmul peak ({peak:.0f} GFLOP/s, CPU time), counting only conv and "
        "linear FLOPs (× the replicas, each on a core of its own):"
    )
    return _section(intro, md_table(header, rows)) if rows else []


def _breakdown(report: dict[str, Any]) -> list[str]:
    breakdowns = report.get("step_breakdown")
    if not breakdowns:
        return []
    rows = []
    for b in breakdowns:
        if "error" in b:
            rows.append([b["batch_size"], b["threads"], f"failed: {b['error'][:120]}", *[""] * len(PARTS)])
            continue
        ms, share = b["median_ms"], b["share"]
        parts = (f"{100 * share[part]:.1f}% ({ms[part]:.2f})" for part in (*PARTS, "other"))
        rows.append([b["batch_size"], b["threads"], f"{ms['step']:.1f}", *parts])
    unprofiled = " and ".join(_fmt(b.get("timed_step_ms"), ".1f") for b in breakdowns)
    whose = "runs'" if len(breakdowns) > 1 else "run's"
    profiled = ":".join(map(str, breakdowns[0]["profiled_steps"]))
    return _section(
        "Where a step goes (profiler spans of a real `train_ddp.py` run): each part's share of the step time, "
        "and its median ms:",
        md_table(["per-process batch", "threads", "step ms", *PARTS, "other"], rows),
        f"Steps profiled after the timed ones (`--profile-steps`, e.g. {profiled}), the first left out (the "
        f"profiler's start-up). The profiler adds time to every op: the same {whose} timed steps, unprofiled, took "
        f"{unprofiled} ms (median). other: setting the learning rate, zero_grad, gradient clipping and the loss "
        "all-reduce. Each run's command and trace: bench.json `step_breakdown`.",
    )


def _data_wait(report: dict[str, Any]) -> list[str]:
    base = [r for r in report["runs"] if r["strategy"] == "baseline" and r.get("data_share") is not None]
    waits = ", ".join(f"{r['nproc']} proc {100 * r['data_share']:.0f}%" for r in base)
    return _section(f"The baseline's DataLoader wait, share of its step time: {waits}.") if base else []


FAST_COLUMNS = ["variant", "samples/s", "× fp32", "GFLOP/s", "% of its dtype's peak", "page faults/step"]


def _fast_paths(report: dict[str, Any]) -> list[str]:
    lines, peaks = [], report["peak_by_threads_gflops"]
    for fast in report.get("fast_paths", []):
        one, rows = fast["threads"] == 1, []
        for name, v in fast["variants"].items():
            dtype = "bf16" if "bf16" in name else "fp32"
            peak = peaks[f"{dtype} 1 thread, CPU time"] if one else report["peak_gflops"][dtype]
            gflops = v["samples_per_s"] * report["model"]["train_flops_per_sample"] / 1e9
            rows.append([name, f"{v['samples_per_s']:.0f}", f"{v['vs_first']:.2f}", f"{gflops:.1f}"])
            rows[-1] += [f"{100 * gflops / peak:.1f}%", f"{v.get('page_faults_per_step', 0):.0f}"]
        threads = f"{fast['threads']} thread{'' if one else 's'}"
        setting = f"batch {fast['batch_size']}, {threads}, {fast['clock']}, interleaved rounds"
        intro = f"Fast paths on one process's step ({setting}):"
        lines += _section(intro, md_table(FAST_COLUMNS, rows))
    return lines


def _conv(report: dict[str, Any]) -> list[str]:
    conv = report.get("conv_diagnosis") or {}
    rows = [
        [name, ", ".join(sorted(set(v["conv_kernels"]))), f"{v['conv_ms']:.1f}", f"{v['reorder_ms']:.1f}"]
        for name, v in conv.items()
    ]
    intro = (
        "conv2 (128×32×26×26, 3×3, forward + backward) in oneDNN (ONEDNN_VERBOSE; ms are one iteration's, single-shot):"
    )
    return _section(intro, md_table(["dtype, layout", "conv kernels", "conv ms", "reorder ms"], rows)) if conv else []


def _profile(report: dict[str, Any]) -> list[str]:
    prof = report.get("profile")
    if not prof:
        return []
    rows = ([group, f"{g['ms_per_step']:.1f}", f"{100 * g['share']:.1f}%"] for group, g in prof["groups"].items())
    intro = (
        f"Profile of the single-process fp32 step ({prof['variant']}, batch {prof['batch_size']}, {prof['threads']} "
        f"threads; torch.profiler self CPU time, {prof['self_cpu_ms_per_step']:.1f} ms/step):"
    )
    return _section(intro, md_table(["op group", "ms/step", "share"], rows))


def _imports(report: dict[str, Any]) -> list[str]:
    imports = report.get("imports")
    if not imports:
        return []
    yes_no = lambda flag: "yes" if flag else "no"
    slowest = ", ".join(f"{k} {v:.2f} s" for k, v in imports["top_level_import_s"].items())
    return _section(
        f"Imports of `python train_ddp.py` (default data set, `-X importtime`): torchvision imported: "
        f"{yes_no(imports['torchvision_imported'])}; PIL: {yes_no(imports['PIL_imported'])}; "
        f"slowest top-level imports: {slowest}."
    )
