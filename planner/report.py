"""The planner's table, its answer to "does it fit", and its figure."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import NamedTuple

from common.config import Config
from common.model_sizes import parameter_count
from planner.measure import RankMemory
from planner.plan import Plan, measure_ranks, variant_config
from runner.layout import would_start


def size(n: float) -> str:
    """Bytes as the textbook writes them: GB (10^9), MB, kB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}" if unit == "GB" else f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _peak_parts(p: Plan) -> str:
    """The peak beyond what a rank keeps all step long (its parameters and optimizer state), and what in it has a
    name; the rest is activations and temporaries."""
    worst = p.worst
    said = [size(worst.peak_bytes - worst.param_bytes - worst.optim_bytes)]
    if p.flags["strategy"] == "ddp":
        said.append(f"of which DDP's gradient buckets {size(worst.grad_bytes)}, kept all step")
    if p.unit_bytes:
        what = {"pippy": "a stage gathered over its replicas", "tp": "the largest unit's TP slice"}
        what = what.get(p.flags["strategy"], "the largest unit")
        said.append(f"of which {what} whole (parameters and gradients) {size(p.unit_bytes)}")
    if worst.in_flight_bytes:
        said.append(f"+ up to {size(worst.in_flight_bytes)} sent and not yet let go by the backend")
    return "; ".join(said)


def table(plans: list[Plan], model: str, model_size: str, *, memory: int | None) -> str:
    n = parameter_count(model_size, model=model)
    name = {"cnn": "BabyCNN", "vit": "BabyViT"}[model]
    lines = [
        f"{name} {model_size}: {n:,} parameters; per rank, the rank that needs the most (AdamW, fp32). "
        "textbook: 16 bytes per parameter / the ranks sharing it.",
        "",
        "| strategy | ranks | params | grads | optimizer | state | textbook | state - textbook | peak of a step "
        "| peak - params - optimizer |" + (" fits |" if memory else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if memory else ""),
    ]
    for p in plans:
        w = p.worst
        fits = ""
        if memory:
            fits = " yes |" if w.peak_bytes + w.in_flight_bytes <= memory else " no |"
        lines.append(
            f"| {p.variant} | {p.world_size} | {size(w.param_bytes)} | {size(w.grad_bytes)} | {size(w.optim_bytes)} | "
            f"{size(w.state_bytes)} | {size(p.textbook_state_bytes)} | {size(w.state_bytes - p.textbook_state_bytes)} "
            f"| {size(w.peak_bytes)} | {_peak_parts(p)} |{fits}"
        )
    lines += [
        "",
        *(
            [
                "(The textbook's 7 B table: 112 GB per rank with DDP, 28 GB with FSDP on 4 ranks, "
                "16 bytes per parameter.)"
            ]
            if model_size == "7b"
            else []
        ),
        "state - textbook: FSDP's dim-0 padding (rows split as ceil(rows / ranks)), AdamW's step counters, a "
        "pipeline stage's share against an even one. The rest of the peak: activations, temporaries and, in FSDP, "
        "the sharded gradients. Peak: the most tensor bytes during a step on fake tensors "
        "(common/memory_peak.py); a real run adds the runtime (CUDA context, NCCL or gloo buffers; ~700 MiB per CPU "
        "process).",
    ]
    return "\n".join(lines)


def seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def time_table(plans: list[Plan], profile_name: str) -> str:
    """Each plan's step, predicted on the profile's machine (planner/timing.py): the slowest rank's compute and
    communication, what of that communication no compute hides, a pipeline's bubble."""
    lines = [
        f"\nTime per step on {profile_name} (planner/timing.py; docs/time.md):",
        "",
        "| strategy | ranks | step | samples/s | MFU | compute | communication | exposed | bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (p for p in plans if p.time):
        t = p.time
        bubble = f"{t.bubble:.0%}" if p.flags["strategy"] == "pippy" else "-"
        lines.append(
            f"| {p.variant} | {p.world_size} | {seconds(t.step_s)} | {t.samples_per_s:,.0f} | {t.mfu:.1%} | "
            f"{seconds(t.compute_s)} | {seconds(t.communication_s)} | {seconds(t.exposed_s)} | {bubble} |"
        )
    return "\n".join(lines)


def fitting(plans: list[Plan], memory: int, *, per_rank_batch: int) -> str:
    """For every plan: the largest per-rank batch whose planned peak fits `memory`, found by planning, not by
    extrapolating (a step's peak is not a straight line in the batch): a batch planned and seen to fit, and the
    next one the variant can run planned and seen not to."""
    lines = [f"\nThe largest per-rank batch that fits {size(memory)} (each planned, and the next one up):", ""]
    for p in plans:
        print(f"searching the largest batch of {p.variant} on {p.world_size} ranks", file=sys.stderr, flush=True)
        found = largest_batch(p, memory, start=per_rank_batch)
        if found is None:
            answer = "no per-rank batch up to 1,024 splits as this variant needs"
        elif found.fits == 0:
            answer = f"none: {size(found.over_bytes)} at {found.over} per rank"
        else:
            over = size(found.over_bytes - memory)
            answer = f"{found.fits:,} ({size(found.fits_bytes)}; {found.over:,} is over by {over})"
        lines.append(f"- {p.variant} on {p.world_size}: {answer}")
    return "\n".join(lines)


class Largest(NamedTuple):
    fits: int  # the largest per-rank batch planned to fit (0: none does)
    over: int  # the next one the variant can run, planned not to
    fits_bytes: int
    over_bytes: int


def largest_batch(p: Plan, memory: int, *, start: int) -> Largest | None:
    """Search the per-rank batches `p`'s variant can run (multiples of the smallest) for the largest whose worst
    rank's planned peak (with a pipeline's in-flight sends) fits: bracket by doubling or halving from `start`, then
    narrow by the line through the bracket's ends, halving where the line stalls. A few plans, seconds each."""
    base = Config(model=p.model, model_size=p.model_size, optimizer=p.optimizer)

    def config(per_rank: int) -> Config | None:  # None: a batch the variant cannot split (micro-batches, replicas)
        cfg = variant_config(p.variant, replace(base, batch_size=per_rank * p.world_size), p.world_size)
        return cfg if cfg is not None and would_start(cfg, p.world_size, planned=True) else None

    step = next((b for b in range(1, 1025) if config(b)), None)
    if step is None:
        return None
    peaks: dict[int, int] = {}

    def peak(k: int) -> int:  # the worst rank's bytes at k * step samples per rank, planned once
        if k not in peaks:
            cfg = config(k * step)
            peaks[k] = max(r.peak_bytes + r.in_flight_bytes for r in _planned(cfg, p.world_size))
        return peaks[k]

    k = max(1, start // step)
    if peak(k) <= memory:
        while peak(2 * k) <= memory:
            k *= 2
        fits, over = k, 2 * k
    else:
        while k > 1 and peak(k // 2) > memory:
            k //= 2
        if k == 1:
            return Largest(0, step, 0, peak(1))
        fits, over = k // 2, k
    while over - fits > 1:
        width = over - fits
        line = fits + (memory - peak(fits)) * width // max(peak(over) - peak(fits), 1)
        guess = min(max(line, fits + 1), over - 1)
        for k in (guess, guess + 1) if width > 3 else (guess,):  # both sides of the line's crossing
            if fits < k < over:
                fits, over = (k, over) if peak(k) <= memory else (fits, k)
        if over - fits > width // 2:  # the line did not halve the bracket: halve it
            mid = (fits + over) // 2
            fits, over = (mid, over) if peak(mid) <= memory else (fits, mid)
    return Largest(fits * step, over * step, peak(fits), peak(over))


def _planned(cfg: Config, world_size: int) -> list[RankMemory]:
    return measure_ranks([(cfg, world_size)])[0]


def draw(plans: list[Plan], out: str, *, memory: int | None) -> None:
    model, model_size = plans[0].model, plans[0].model_size
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    variants = list(dict.fromkeys(p.variant for p in plans))
    for i, variant in enumerate(variants):
        mine = [p for p in plans if p.variant == variant]
        worlds = [p.world_size for p in mine]
        ax.plot(worlds, [p.worst.peak_bytes / 1e9 for p in mine], "o-", color=f"C{i}", label=f"{variant}: peak")
        ax.plot(worlds, [p.worst.state_bytes / 1e9 for p in mine], "s:", color=f"C{i}", alpha=0.6, label="  state")
    if memory:
        ax.axhline(memory / 1e9, color="black", linestyle="--", linewidth=1, label=f"device memory {size(memory)}")
    ax.set(xscale="log", yscale="log", xlabel="ranks", ylabel="GB per rank (the rank that needs the most)")
    name = {"cnn": "BabyCNN", "vit": "BabyViT"}[model]
    n = parameter_count(model_size, model=model)
    ax.set_title(f"{name} {model_size} ({n:,} parameters): memory per rank, planned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
