"""The figures of bench.collectives (busbw against message size) and bench.scale (memory per rank and speed against
the parameters). matplotlib only, no torch."""

from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure  # no pyplot: no backend, no display

from bench.report import human


def _save(fig: Figure, axes: Sequence[Any], path: Path) -> None:
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def collectives(run: dict[str, Any], path: Path, *, ops: Sequence[str]) -> None:
    """busbw against message size (log-x), one line per op."""
    fig = Figure(figsize=(6, 4.6))
    ax = fig.subplots()
    for i, op in enumerate(ops):  # an op's colour whatever --ops measured
        if rows := [r for r in run["results"] if r["op"] == op]:
            ax.plot([r["bytes"] for r in rows], [r["busbw_GBps"] for r in rows], "o-", ms=3, color=f"C{i}", label=op)
    sizes = [r["bytes"] for r in run["results"]]
    ticks = [4**k for k in range(40) if 0.9 * min(sizes) <= 4**k <= 1.1 * max(sizes)]  # 4 KiB, 16 KiB, ..
    ax.set_xscale("log")
    ax.minorticks_off()
    ax.set_xticks(ticks, [human(t) for t in ticks], fontsize=8)
    ax.grid(alpha=0.3)
    where = (
        f"{run['world_size']} processes, {run['backend']} on {run['device']}; {run['machine']}, torch {run['torch']}"
    )
    ax.set(xlabel="message size (nccl-tests' size)", ylabel="busbw (GB/s)")
    ax.set_title(f"{where}, {run['date']}", fontsize=9)
    _save(fig, [ax], path)


def scale(rows: list[dict[str, Any]], path: Path, *, nproc: int, budget: float | None) -> None:
    """Peaks per rank, planned (o--), measured (x) or refused (hollow), a colour per strategy; and the speed."""
    fig = Figure(figsize=(14, 5))
    ax_mem, ax_speed = fig.subplots(1, 2)
    for i, strategy in enumerate(dict.fromkeys(r["strategy"] for r in rows)):
        mine = [r for r in rows if r["strategy"] == strategy and "planned_peak_bytes" in r]
        points = lambda key, rows: (
            [r["parameters"] for r in rows],
            [r[key] / (1e9 if "bytes" in key else 1) for r in rows],
        )
        ax_mem.plot(*points("planned_peak_bytes", mine), "o--", color=f"C{i}", label=strategy)
        ax_mem.plot(
            *points("measured_peak_bytes", [r for r in mine if "measured_peak_bytes" in r]),
            "x",
            color=f"C{i}",
            markersize=10,
        )
        refused = [r for r in mine if "refused" in r]
        ax_mem.plot(*points("planned_peak_bytes", refused), "o", color="white", markeredgecolor=f"C{i}", markersize=12)
        if speed := [r for r in mine if "samples_per_s" in r]:
            ax_speed.plot(*points("samples_per_s", speed), "o-", color=f"C{i}", label=strategy)
    if budget:
        ax_mem.axhline(budget / 1e9, color="black", linestyle=":", linewidth=1, label="what each process may have here")
    title = f"peak of a step per rank on {nproc} processes: planned (o--), measured (x), refused (hollow)"
    ax_mem.set(xscale="log", yscale="log", xlabel="parameters", ylabel="GB per rank", title=title)
    ax_speed.set(xscale="log", yscale="log", xlabel="parameters", ylabel="samples/s", title="training speed")
    _save(fig, [ax_mem, ax_speed], path)
