"""The planner's table, its answer to "does it fit", and its figure."""

from __future__ import annotations

from common.config import Config
from common.model_sizes import parameter_count
from planner.measure import plan_rank
from planner.plan import Plan, variant_config


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


def fitting(plans: list[Plan], memory: int, *, per_rank_batch: int) -> str:
    """For every plan: the largest per-rank batch whose peak fits `memory` (a peak grows linearly with the batch:
    planned again at twice the batch, the two points give the line)."""
    lines = [f"\nThe largest per-rank batch that fits {size(memory)}:", ""]
    for p in plans:
        w = p.worst
        batch = 2 * per_rank_batch * p.world_size
        base = Config(model=p.model, model_size=p.model_size, optimizer=p.optimizer, batch_size=batch)
        twice = plan_rank(variant_config(p.variant, base, p.world_size), p.world_size, w.rank)
        per_sample = (twice.peak_bytes - w.peak_bytes) / per_rank_batch
        fixed = w.peak_bytes + w.in_flight_bytes - per_sample * per_rank_batch
        if fixed > memory:
            answer = f"none: {size(fixed)} before the first sample"
        else:
            answer = f"{int((memory - fixed) / per_sample) if per_sample > 0 else 'any'}"
        lines.append(f"- {p.variant} on {p.world_size}: {answer}")
    return "\n".join(lines)


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
