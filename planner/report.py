"""The planner's table, its answer to "does it fit", and its figure."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, replace
from typing import Any, Callable, NamedTuple

from common.config import Config
from common.model_sizes import parameter_count
from planner.measure import RankMemory
from planner.plan import Plan, measure_ranks, variant_config
from planner.timing import Profile
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


NAMES = {"cnn": "BabyCNN", "vit": "BabyViT", "gpt": "BabyGPT"}


def _parameters(model: str, model_size: str) -> int:
    return parameter_count(model_size, "copy" if model == "gpt" else "digits", model)


def table(plans: list[Plan], model: str, model_size: str, *, memory: int | None) -> str:
    n = _parameters(model, model_size)
    batch = ""
    if plans and model == "gpt":  # its batch in sequences of seq_len tokens
        p = plans[0]
        batch = f"; {p.per_rank_batch:,} sequence(s) of {p.flags['seq_len']:,} tokens per rank"
    lines = [
        f"{NAMES[model]} {model_size}: {n:,} parameters{batch}; per rank, the rank that needs the most (AdamW, fp32 "
        "state). textbook: 16 bytes per parameter / the ranks sharing it.",
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
    tokens = any(p.model == "gpt" for p in plans)  # a language's: tokens per second per rank, as papers give it
    lines = [
        f"\nTime per step on {profile_name} (planner/timing.py; docs/time.md):",
        "",
        f"| strategy | ranks | step | {'tokens/s per rank' if tokens else 'samples/s'} | MFU | compute | communication "
        "| exposed | bubble |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in (p for p in plans if p.time):
        t = p.time
        bubble = f"{t.bubble:.0%}" if p.flags["strategy"] == "pippy" else "-"
        rate = t.samples_per_s * p.flags["seq_len"] / p.world_size if tokens else t.samples_per_s
        lines.append(
            f"| {p.variant} | {p.world_size} | {seconds(t.step_s)} | {rate:,.0f} | {t.mfu:.1%} | "
            f"{seconds(t.compute_s)} | {seconds(t.communication_s)} | {seconds(t.exposed_s)} | {bubble} |"
        )
    return "\n".join(lines)


def fitting(plans: list[Plan], memory: int, *, per_rank_batch: int) -> str:
    """For every plan: the largest per-rank batch whose planned peak fits `memory`, found by planning, not by
    extrapolating (a step's peak is not a straight line in the batch): a batch planned and seen to fit, and the
    next one the variant can run planned and seen not to."""
    replicas = " (CP: per replica)" if any(p.flags.get("strategy") == "cp" for p in plans) else ""
    lines = [
        f"\nThe largest per-rank batch{replicas} that fits {size(memory)} (each planned, and the next one up):",
        "",
    ]
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
    own = {k: p.flags[k] for k in ("precision", "seq_len") if k in p.flags}  # (what the variant does not set)
    base = Config(model=p.model, model_size=p.model_size, optimizer=p.optimizer, **own)

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

    fits, over = _bracket(peak, memory, max(1, start // step))
    if fits == 0:
        return Largest(0, step, 0, peak(1))
    return Largest(fits * step, over * step, peak(fits), peak(over))


def _bracket(peak: Callable[[int], int], memory: int, k: int, *, top: int = 0) -> tuple[int, int]:
    """(the largest multiple whose `peak` fits `memory`, the next one up, which does not), from `k`: bracket by
    doubling or halving, then narrow by the line through the bracket's ends, halving where the line stalls. (0, 1):
    none fits; (top, 0): `top` (when given) fits, nothing above it was looked at."""
    if peak(k) <= memory:
        while True:
            up = min(2 * k, top) if top else 2 * k
            if up == k:
                return k, 0
            if peak(up) > memory:
                break
            k = up
        fits, over = k, up
    else:
        while k > 1 and peak(k // 2) > memory:
            k //= 2
        if k == 1:
            return 0, 1
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
    return fits, over


# The longest sequence is searched past a shape's published context (its rotary positions are computed for any
# position: what a context extension such as Llama 3.1's to 128 k would hold), up to this many tokens
LONGEST_SEARCHED = 2**24


def sequence_step(p: Plan, granule: int) -> int:
    """The lengths the longest-sequence search tries are multiples of this: `granule`, 2 x cp (CP's head and tail
    chunk per rank), TP's degree with sequence parallel (tokens split over "tp"), 2 (the built-in copy task)."""
    world, flags = p.world_size, p.flags
    needs = [granule, 2]
    if flags.get("strategy") == "cp":
        needs.append(2 * (world // flags["dp"]))
    if flags.get("sequence_parallel"):
        needs.append(flags.get("tp", 1) if flags.get("strategy") == "pippy" else world // flags["dp"])
    return math.lcm(*needs)


class Longest(NamedTuple):
    fits: int  # the longest --seq-len planned to fit (0: none does)
    over: int  # the next one the search tried above it, planned not to (0: none above LONGEST_SEARCHED tried)
    fits_bytes: int
    over_bytes: int
    step: int  # the multiples searched (sequence_step)


def longest_sequence(p: Plan, memory: int, *, per_rank_batch: int, granule: int = 1024) -> Longest | None:
    """The longest --seq-len (a multiple of sequence_step) whose worst rank's planned peak fits `memory`, `p`'s
    variant, world and --per-rank-batch (CP: sequences per replica) as they are: found as largest_batch finds the
    batch, by plans on both sides (that length fits, the next multiple does not). None: no length the variant runs."""
    from unittest import mock

    from common.gpt_sizes import GPT_SIZES

    step = sequence_step(p, granule)
    base = Config(model=p.model, model_size=p.model_size, optimizer=p.optimizer, precision=p.flags["precision"])
    base = replace(base, batch_size=per_rank_batch * p.world_size)
    lifted = {p.model_size: GPT_SIZES[p.model_size]._replace(context=LONGEST_SEARCHED)}

    def config(seq_len: int) -> Config | None:
        cfg = variant_config(p.variant, replace(base, seq_len=seq_len), p.world_size)
        return cfg if cfg is not None and would_start(cfg, p.world_size, planned=True) else None

    peaks: dict[int, int] = {}

    def peak(k: int) -> int:  # the worst rank's bytes at k * step tokens, planned once
        if k not in peaks:
            cfg = config(k * step)
            peaks[k] = max(r.peak_bytes + r.in_flight_bytes for r in _planned(cfg, p.world_size))
        return peaks[k]

    with mock.patch.dict(GPT_SIZES, lifted):
        if config(step) is None:
            return None
        fits, over = _bracket(peak, memory, max(1, p.flags["seq_len"] // step), top=LONGEST_SEARCHED // step)
        if fits == 0:
            return Longest(0, step, 0, peak(1), step)
        return Longest(fits * step, over * step, peak(fits), peak(over) if over else 0, step)


def longest(plans: list[Plan], memory: int, *, per_rank_batch: int, granule: int = 1024) -> tuple[str, list]:
    """The text and, per plan, the JSON of longest_sequence."""
    lines = [
        f"\nThe longest sequence that fits {size(memory)} at {per_rank_batch} sequence(s) per rank (CP: per "
        f"replica), in multiples of {granule:,} tokens and what the variant needs (each planned, and the next one up):",
        "",
    ]
    found = []
    for p in plans:
        print(f"searching the longest sequence of {p.variant} on {p.world_size} ranks", file=sys.stderr, flush=True)
        got = longest_sequence(p, memory, per_rank_batch=per_rank_batch, granule=granule)
        if got is None:
            answer = "no --seq-len this variant can run"
        elif got.fits == 0:
            answer = f"none: {size(got.over_bytes)} at {got.over:,} tokens"
        elif got.over == 0:
            answer = f"{got.fits:,} tokens or more ({size(got.fits_bytes)}; the search's end)"
        else:
            over = size(got.over_bytes - memory)
            answer = f"{got.fits:,} tokens ({size(got.fits_bytes)}; {got.over:,} is over by {over})"
        lines.append(f"- {p.variant} on {p.world_size}: {answer}")
        found.append(got._asdict() if got else None)
    return "\n".join(lines), found


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
    n = _parameters(model, model_size)
    ax.set_title(f"{NAMES[model]} {model_size} ({n:,} parameters): memory per rank, planned")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


@dataclass(frozen=True)
class Published:
    """A published measurement of an LLM's training whose model BabyGPT's shapes express: how it ran, as the planner
    plans it (`plans`: (what it is planned as, its Config's fields), one or more where the run did what the planner
    cannot do exactly), and what it measured per GPU. Nothing is fitted on it: the planner's profile and count alone."""

    name: str
    cite: str
    world_size: int
    plans: tuple[tuple[str, dict[str, Any]], ...]
    tokens_per_gpu: float | None = None  # tokens/s per GPU
    memory_gib: float | None = None  # per GPU, the most any GPU held
    mfu: float | None = None


_TITAN = (
    "Liang et al. 2024, TorchTitan (arXiv 2410.06511): pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md"
)
_TITAN_8B = {"model_size": "llama3-8b", "seq_len": 8192, "precision": "bf16", "strategy": "fsdp", "sharding": "full"}
_LLAMA3 = "Dubey et al. 2024, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4"
_LLAMA3_405B = {"model_size": "llama3-405b", "seq_len": 8192, "precision": "bf16", "strategy": "pippy", "tp": 8}


def _titan(world: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """torchtitan's FSDP run (a unit per block, 2 sequences a GPU, selective activation checkpointing: every other
    matmul's output kept) planned as the two ends the planner has: no checkpointing, and every block checkpointed."""
    flags = {**_TITAN_8B, "shard_units": "blocks", "batch_size": 2 * world}
    return (
        ("fsdp full, a unit per block", flags),
        ("fsdp full, a unit per block, checkpointed", {**flags, "activation_checkpointing": True}),
    )


def _llama3(dp: int, per_replica: int) -> tuple[tuple[str, dict[str, Any]], ...]:
    """Llama 3's 405B run: TP 8 in a node, 16 pipeline stages (they interleave stages; planned as 1F1B, a stage a
    rank), FSDP over the replicas, micro-batches of one sequence."""
    flags = {**_LLAMA3_405B, "schedule": "1f1b", "dp": dp, "n_microbatches": per_replica}
    return (("fsdp x pp x tp (tp 8, pp 16, 1f1b)", {**flags, "batch_size": dp * per_replica}),)


PUBLISHED = (
    Published(
        "torchtitan-8b-8",
        f"{_TITAN}, Table 1, FSDP: Llama 3.1 8B on 8 H100 (96 GB HBM2e, 500 W), 2 sequences of 8,192 a GPU, bf16, "
        "selective activation checkpointing; memory: the most the allocator reserved",
        8,
        _titan(8),
        tokens_per_gpu=5762,
        memory_gib=82.4,
    ),
    Published(
        "torchtitan-8b-128",
        f"{_TITAN}, Table 3, FSDP: the same on 128 H100",
        128,
        _titan(128),
        tokens_per_gpu=5605,
        memory_gib=67.0,
    ),
    Published(
        "llama3-405b-8k",
        f"{_LLAMA3}: Llama 3 405B on 8,192 H100 (80 GB, 700 W), TP 8, PP 16, DP 64, 32 sequences of 8,192 per "
        "replica, bf16: 430 TFLOP/s a GPU",
        8192,
        _llama3(64, 32),
        mfu=0.43,
    ),
    Published(
        "llama3-405b-16k",
        f"{_LLAMA3}: the same on 16,384 H100, DP 128, 16 sequences per replica: 400 TFLOP/s a GPU",
        16384,
        _llama3(128, 16),
        mfu=0.41,
    ),
)


def plan_published(items: list[Published], profile: Profile, *, workers: int = 1) -> list[list[Plan]]:
    """Each of the ways each of `items` is planned (Published.plans), its step timed on `profile`, in `workers`
    processes."""
    from planner.jobs import say
    from planner.plan import plan_configs

    named = []
    for item in items:
        for label, flags in item.plans:
            cfg = Config(model="gpt", train_size=flags["batch_size"], **flags)
            cfg.check(world_size=item.world_size)  # (a run the scripts would start)
            named.append((label, cfg, item.world_size))
    started = lambda name, n: say(f"planning {name} on {n:,} ranks")  # noqa: E731
    plans = iter(plan_configs(named, profile=profile, workers=workers, started=started))
    return [[next(plans) for _ in item.plans] for item in items]


def _error(planned: float, published: float | None) -> str:
    return f"{planned / published - 1:+.0%}" if published else "-"


def published_table(items: list[Published], plans: list[list[Plan]], profile_name: str) -> str:
    """The planned step and memory beside each published measurement, and the planner's error against it
    (planned / published - 1): tokens/s and memory per GPU, MFU (the model's FLOPs, attention's scores a full
    square, as PaLM counts them, over the step and the GPUs' peak); and where the planned step goes."""
    lines = [
        f"Published measurements beside the planner's plans of them (their shapes and layouts, on {profile_name}; "
        "nothing fitted on them). Error: planned / published - 1. Memory: the rank that needs the most, its peak.",
        "",
        "| measurement | planned as | tokens/s per GPU: published | planned | error | memory per GPU: published "
        "| planned | error | MFU: published | planned | error | step | exposed communication | bubble |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for item, planned in zip(items, plans):
        for p in planned:
            t, w = p.time, p.worst
            tokens = t.samples_per_s * p.flags["seq_len"] / p.world_size
            memory = (w.peak_bytes + w.in_flight_bytes) / 2**30
            had = (
                f"{item.tokens_per_gpu:,.0f}" if item.tokens_per_gpu else "-",
                f"{item.memory_gib:.1f} GiB" if item.memory_gib else "-",
                f"{item.mfu:.0%}" if item.mfu else "-",
            )
            bubble = f"{t.bubble:.0%}" if p.flags["strategy"] == "pippy" else "-"
            lines.append(
                f"| {item.name} | {p.variant} | {had[0]} | {tokens:,.0f} | {_error(tokens, item.tokens_per_gpu)} | "
                f"{had[1]} | {memory:.1f} GiB | {_error(memory, item.memory_gib)} | {had[2]} | {t.mfu:.1%} | "
                f"{_error(t.mfu, item.mfu)} | {seconds(t.step_s)} | {seconds(t.exposed_s)} | {bubble} |"
            )
    lines += ["", *(f"- {item.name}: {item.cite}" for item in items)]
    return "\n".join(lines)
