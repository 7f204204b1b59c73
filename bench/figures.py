"""The figures of bench.collectives (busbw against message size) and bench.scale (memory per rank and speed against
the model's size). matplotlib only, no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def human(nbytes: float) -> str:
    """4096 -> '4 KiB', 268435456 -> '256 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def collectives(runs: list[dict[str, Any]], path: Path, *, ops: Sequence[str]) -> None:
    """busbw against message size (log-x), one line per op; one panel per process count, side by side on one y
    axis. A repeated launch of the same count is drawn in its panel too, dotted: how far the launches differ."""
    plt = _pyplot()
    counts = sorted({run["world_size"] for run in runs})
    fig, axes = plt.subplots(1, len(counts), figsize=(6 * len(counts), 4.6), sharey=True, squeeze=False)
    for ax, count in zip(axes[0], counts):
        launches = [run for run in runs if run["world_size"] == count]
        for k, run in enumerate(launches):
            for i, op in enumerate(ops):
                rows = [r for r in run["results"] if r["op"] == op]
                style = {"ls": "-", "marker": "o", "ms": 3} if k == 0 else {"ls": ":", "lw": 1, "alpha": 0.8}
                busbw = [r["busbw_GBps"] for r in rows]
                ax.plot([r["bytes"] for r in rows], busbw, color=f"C{i}", label=op if k == 0 else None, **style)
        sizes = [r["bytes"] for run in launches for r in run["results"]]
        ticks = [4**k for k in range(40) if 0.9 * min(sizes) <= 4**k <= 1.1 * max(sizes)]  # 4 KiB, 16 KiB, ..
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(ticks, [human(t) for t in ticks], fontsize=8)
        ax.grid(alpha=0.3)
        repeats = f" ({len(launches)} launches: first solid, others dotted)" if len(launches) > 1 else ""
        ax.set(xlabel="message size (nccl-tests' size)", title=f"{count} processes, {launches[0]['backend']}{repeats}")
    axes[0][0].set_ylabel("busbw (GB/s)")
    axes[0][0].legend(fontsize=8)
    first = runs[0]
    fig.suptitle(f"{first['machine']}, {first['device']}, torch {first['torch']}, {first['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def scale(rows: list[dict[str, Any]], out: Path, *, nproc: int, budget_bytes: float | None) -> None:
    """Planned (o, dashed) and measured (x) peaks per rank, a colour per strategy; a refused run's plan hollow; the
    memory a process may have here (`budget_bytes`) dotted."""
    plt = _pyplot()
    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(14, 5))
    for i, variant in enumerate(dict.fromkeys(r["variant"] for r in rows)):
        mine = [r for r in rows if r["variant"] == variant]
        params = [r["parameters"] for r in mine]
        ax_mem.plot(params, [r["planned"]["peak_bytes"] / 1e9 for r in mine], "o--", color=f"C{i}", label=f"{variant}")
        measured = [(r["parameters"], r["measured_peak_bytes"] / 1e9) for r in mine if r.get("measured_peak_bytes")]
        if measured:
            ax_mem.plot(*zip(*measured), "x", color=f"C{i}", markersize=10)
        refused = [(r["parameters"], r["planned"]["peak_bytes"] / 1e9) for r in mine if r.get("fits") is False]
        if refused:
            ax_mem.plot(*zip(*refused), "o", color="white", markeredgecolor=f"C{i}", markersize=12)
        speed = [(r["parameters"], r["samples_per_s"]) for r in mine if r.get("samples_per_s")]
        if speed:
            ax_speed.plot(*zip(*speed), "o-", color=f"C{i}", label=variant)
    if budget_bytes:
        label = "what each of the processes may have here"
        ax_mem.axhline(budget_bytes / 1e9, color="black", linestyle=":", linewidth=1, label=label)
    title = f"peak of a step per rank on {nproc} processes: planned (o--), measured (x), refused (hollow)"
    ax_mem.set(xscale="log", yscale="log", xlabel="parameters", ylabel="GB per rank", title=title)
    ax_speed.set(xscale="log", yscale="log", xlabel="parameters", ylabel="samples/s", title="training speed")
    for ax in (ax_mem, ax_speed):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
