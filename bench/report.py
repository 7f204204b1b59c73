"""The benchmark's arithmetic on its rows (ratios to the baseline and to fp32, achieved FLOP/s, the scaling table)
and bench.md, one function per part ([] when the report lacks it); docs/performance.md reads them. No torch."""

from typing import Any, Iterable, Sequence

RUN_COLUMNS = ["run", "precision", "procs", "samples/s", "× baseline", "step ms: median (p10–p90)"]
RUN_COLUMNS += ["launch → 1st step s", "tensors/rank MB", "peak RSS/rank MB", "GFLOP/s", "% of peak", "test acc"]


def md_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    """A Markdown table's lines; a cell is printed with str()."""
    line = lambda cells: "|" + "".join(f" {c} |" if str(c) else " |" for c in cells)
    return [line(header), "|" + "---|" * len(header), *map(line, rows)]


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def human(nbytes: float) -> str:
    """4096 -> '4 KiB', 268435456 -> '256 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def _spread(values: Sequence[float] | None, spec: str, what: str) -> str:
    """' (min–max what)' of several values (`what` may name their number, {n}), else ''."""
    values = [v for v in values or [] if v]
    return f" ({min(values):{spec}}–{max(values):{spec}}{what.format(n=len(values))})" if len(values) > 1 else ""


def _baselines(rows: list[dict]) -> dict[int, dict[str, Any]]:
    """Process count -> the baseline's row (its median launch)."""
    return {r["nproc"]: r for r in rows if r["strategy"] == "baseline" and r.get("samples_per_s")}


def _round_ratios(row: dict[str, Any], other: dict[str, Any]) -> list[float]:
    rounds = zip(row.get("samples_per_s_of_each_launch", []), other.get("samples_per_s_of_each_launch", []))
    return [a / b for a, b in rounds if a and b]


def annotate(rows: list[dict], *, flops_per_sample: float, peaks: dict[str, float]) -> None:
    """Add achieved GFLOP/s, its fraction of the machine's peak, and the ratio to the baseline and of bf16 to its
    fp32 twin, each also round by round."""
    baseline = _baselines(rows)
    fp32_twin = {(r["name"], r["nproc"], r["launcher"]): r for r in rows if r["precision"] == "fp32"}
    for row in (row for row in rows if row.get("samples_per_s")):
        row["model_gflops"] = row["samples_per_s"] * flops_per_sample / 1e9
        peak = peaks.get(row["precision"])
        row["peak_fraction"] = row["model_gflops"] / peak if peak else None
        rival = baseline.get(row["nproc"])
        if rival:
            row["vs_baseline"] = row["samples_per_s"] / rival["samples_per_s"]
            ratios = _round_ratios(row, rival)
            if len(ratios) > 1 and row["strategy"] != "baseline":
                row["vs_baseline_each_round"] = ratios
        twin = fp32_twin.get((row["name"], row["nproc"], row["launcher"]))
        if row["precision"] == "bf16" and twin and twin.get("samples_per_s"):  # the bf16 speed-up, side by side
            row["vs_fp32"] = row["samples_per_s"] / twin["samples_per_s"]
            row["vs_fp32_each_round"] = _round_ratios(row, twin)


def scaling_table(rows: list[dict]) -> dict[str, dict[str, float]]:
    """Run name -> process count -> fp32 samples/s of the runs at the benchmark's settings on several counts."""
    table: dict[str, dict[str, float]] = {}
    for r in rows:
        if r.get("ok") and r["precision"] == "fp32" and r.get("samples_per_s"):
            table.setdefault(r["name"], {})[str(r["nproc"])] = r["samples_per_s"]
    return {k: v for k, v in table.items() if len(v) > 1}


def markdown(report: dict[str, Any]) -> str:
    parts = [_header, _runs, _ratios]
    return "\n".join(line for part in parts for line in part(report)) + "\n"


def _section(*paragraphs: str | list[str]) -> list[str]:
    """The lines of a section: each paragraph (a line, or a table's lines) after an empty line."""
    return [line for p in paragraphs for line in ["", *([p] if isinstance(p, str) else p)]]


def _header(report: dict[str, Any]) -> list[str]:
    """The machine and how busy it was, the settings, the matmul peak and the model's FLOPs."""
    m, s, peaks = report["machine"], report["settings"], report["peak_by_threads_gflops"]
    loaded = "" if m["quiet"] else " -- **not quiet: other work shared the cores, the figures are inflated**"
    return [
        f"Machine: {m['cpu']}, {m['cores']} cores, torch {m['torch']}; load average (1 min) before: "
        f"{m['load_before'][0]:.2f}; other processes used {m['other_processes_cores']:.2f} cores on average "
        f"during the {m['bench_wall_s']:.0f} s run{loaded}.",
        "",
        f"Global batch {s['batch_size']}; {s['warmup_steps']} warm-up steps, then {s['timed_steps']} timed (the full "
        f"run: all steps after the warm-up). Matmul peak ({s['peak_n']}^3, best of {s['peak_repeats']}): "
        f"{', '.join(f'{k} {v:.0f}' for k, v in peaks.items())} GFLOP/s; a run's % of peak is of the all-cores "
        f"figure in its dtype. Model: {report['model']['train_flops_per_sample'] / 1e6:.1f} MFLOP per sample "
        "(forward + backward).",
    ]


def _runs(report: dict[str, Any]) -> list[str]:
    mb = lambda values: fmt(max((v for v in values or [] if v), default=None), ".0f", 1e-6)  # the rank's with most
    rows = []
    for r in report["runs"]:
        if not r.get("ok"):
            rows.append([r["name"], r["precision"], r["nproc"], f"failed: {r.get('error', '')[:120]}", *[""] * 8])
            continue
        st, g = r.get("step_time_s"), r.get
        runner = " (`run_ddp.sh`" + (", full run)" if r["full"] else ")") if r["launcher"] == "run_ddp.sh" else ""
        launches = _spread(g("samples_per_s_of_each_launch"), ".0f", " over {n} launches")
        ratio = fmt(g("vs_baseline"), ".2f") + _spread(g("vs_baseline_each_round"), ".2f", " by round")
        step_ms = f"{1e3 * st['median']:.1f} ({1e3 * st['p10']:.0f}–{1e3 * st['p90']:.0f})" if st else "-"
        first = fmt(g("launch_to_first_step_s"), ".1f")
        rows.append([r["name"] + runner, r["precision"], r["nproc"], fmt(g("samples_per_s"), ".0f") + launches])
        rows[-1] += [ratio, step_ms, first, mb(g("tensor_bytes_per_rank")), mb(g("peak_rss_bytes"))]
        rows[-1] += [fmt(g("model_gflops"), ".1f"), fmt(g("peak_fraction") or None, ".1f", 100)]
        rows[-1] += [fmt(g("test_accuracy"), ".2f", 100)]
    return _section(md_table(RUN_COLUMNS, rows)) if rows else []


def _ratios(report: dict[str, Any]) -> list[str]:
    """bf16 against fp32 (by round, where launched in the same rounds), the scaling table, the DataLoader's wait."""
    lines, scaling = [], report.get("scaling") or {}
    for r in (r for r in report["runs"] if r.get("vs_fp32")):
        where = f"{r['name']} on {r['nproc']} process{'es' if r['nproc'] > 1 else ''}"
        rounds = _spread(r.get("vs_fp32_each_round"), ".2f", " by round")
        lines += _section(f"bf16 against fp32, {where}: {r['vs_fp32']:.2f}×{rounds}.")
    procs = sorted({p for row in scaling.values() for p in row}, key=int)
    cell = lambda v, one: "-" if v is None else f"{v:.0f}" + (f" ({v / one:.2f}×)" if one else "")
    rows = ([name, *(cell(row.get(p), row.get("1")) for p in procs)] for name, row in scaling.items())
    if scaling:
        table = md_table(["run", *(f"{p} proc" for p in procs)], rows)
        lines += _section("Scaling, fp32 samples/s (× the same run on 1 process):", table)
    base = [r for r in report["runs"] if r["strategy"] == "baseline" and r.get("data_share") is not None]
    waits = ", ".join(f"{r['nproc']} proc {100 * r['data_share']:.0f}%" for r in base)
    return lines + (_section(f"The baseline's DataLoader wait, share of its step time: {waits}.") if base else [])
