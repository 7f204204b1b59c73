"""What to plan, and the textbook beside it: the strategy variants a plan covers, each one's layout at a world size,
the ranks worth measuring, and the textbook's bytes per rank with what the measurement adds to them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from common.config import Config
from common.errors import ConfigError
from common.model_sizes import blocks, layers, max_stages, parameter_count, tp_degree, tp_fsdp_units, tp_layer_params
from planner.count import Collective, StepCount
from planner.jobs import Job, measure, same_but_rank, tp_slices
from planner.measure import RankMemory
from planner.predict import state_bytes_theory, tp_state_bytes_theory
from planner.timing import Profile, StepTime, predict
from runner.layout import would_start

DEFAULT_VARIANTS = ("ddp", "fsdp full, a unit per layer", "fsdp full, one unit", "pipeline 1f1b", "fsdp x tp")
ALL_VARIANTS = (
    *DEFAULT_VARIANTS,
    "fsdp grad-op, a unit per layer",
    "fsdp hybrid, a unit per layer",
    "fsdp none",
    "pipeline gpipe",
)
# The ViT's: a unit per block, with and without each block checkpointed; TP by heads, with sequence parallel and
# inside a pipeline (the 3-D mesh, docs/mesh.md)
VIT_VARIANTS = (
    *("ddp", "fsdp full, a unit per block", "fsdp full, a unit per block, checkpointed", "pipeline 1f1b"),
    *("fsdp x tp", "fsdp x tp, sequence parallel", "fsdp x pp x tp"),
)
GPT_VARIANTS = VIT_VARIANTS  # BabyGPT's: the same, its blocks the units, the stages' cuts and what TP splits
# Context parallelism (train_cp.py: the ring over cp ranks, FSDP over every rank, world / cp replicas), BabyGPT's only:
# planned when named (--variants) or with --all. Its --per-rank-batch is sequences per replica, each rank 1/cp of them
CP_DEGREES = (2, 4, 8, 16, 32, 64)
CP_VARIANTS = tuple(f"cp {c}{ckpt}" for c in CP_DEGREES for ckpt in ("", ", checkpointed"))


@dataclass
class Plan:
    """One strategy variant at one world size: what each rank planned holds."""

    variant: str
    world_size: int
    model_size: str
    optimizer: str
    flags: dict[str, Any]  # the Config fields that make the variant (its run's flags)
    ranks: list[RankMemory] = field(default_factory=list)
    time: StepTime | None = None  # with a machine profile (planner/timing.py)
    textbook_state_bytes: float = 0.0  # 16 bytes per parameter (AdamW, fp32), divided by the ranks sharing it
    unit_bytes: int = 0  # FSDP: the largest unit's parameters and gradients held whole while it runs
    model: str = "cnn"
    batch_size: int = 0  # the global batch: samples (BabyGPT's: sequences) per optimizer step
    depths: tuple[int, ...] = ()  # a deep BabyGPT's or ViT's: the two depths planned, extrapolated (measure_ranks)

    @property
    def per_rank_batch(self) -> int:
        """Sequences (samples) per rank; CP's per replica, each of its ranks 1/cp of every one."""
        return self.batch_size // (self.flags["dp"] if self.flags.get("strategy") == "cp" else self.world_size)

    @property
    def worst(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.peak_bytes + r.in_flight_bytes)

    def to_json(self) -> dict[str, Any]:
        ranks = [{f.name: getattr(r, f.name) for f in fields(r) if f.name != "count"} for r in self.ranks]
        for rank, r in zip(ranks, self.ranks):
            rank["count"] = r.count.to_json() if r.count else None
        mine = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("ranks", "time")}
        return {**mine, "ranks": ranks, "time": self.time.to_json() if self.time else None}


def variant_config(variant: str, base: Config, world_size: int) -> Config | None:
    """The Config of `variant` at `world_size`, or None where it cannot run (hybrid on an odd world, a pipeline
    whose ranks do not divide the world, TP on an odd one). Its data set holds at least one global batch: the
    planner plans a step, not an epoch."""
    base = replace(base, train_size=max(base.batch_size, base.train_size))
    if variant.startswith("fsdp x tp"):  # TP over up to 8 ranks (its collectives want one machine's links) that
        # the model's heads (and, with sequence parallel, its tokens) allow; FSDP across
        sp = variant.endswith("sequence parallel")
        tps = (
            replace(base, strategy="tp", dp=world_size // t, sequence_parallel=sp)
            for t in (8, 4, 2, 1)
            if world_size % t == 0
        )
        cfg = next((c for c in tps if would_start(c, world_size, planned=True)), None)
        return cfg if cfg and (cfg.dp < world_size or world_size == 1) else None
    if variant == "fsdp x pp x tp":  # the same TP, a pipeline of up to 4 ranks around it, FSDP over the replicas
        for t in (t for t in (8, 4, 2) if world_size % t == 0):
            pp = min(4, world_size // t, max_stages(base.model_size, base.model))
            cfg = replace(base, strategy="pippy", schedule="1f1b", tp=t, dp=world_size // (t * pp))
            cfg = replace(cfg, n_microbatches=max(4, pp))
            if pp > 1 and (world_size // t) % pp == 0 and would_start(cfg, world_size, planned=True):
                return cfg
        return None
    if variant.startswith("cp "):  # cp ranks a ring, world / cp replicas of it, FSDP over all (train_cp.py)
        cp = int(variant.split(",")[0].split()[1])
        if world_size % cp or base.batch_size % cp:
            return None
        cfg = replace(
            base,
            strategy="cp",
            dp=world_size // cp,
            batch_size=base.batch_size // cp,  # (the replicas' sequences: the per-rank batch is a replica's)
            activation_checkpointing=variant.endswith("checkpointed"),
        )
        return cfg if would_start(cfg, world_size, planned=True) else None
    name, _, units = variant.partition(", ")
    strategy, _, mode = name.partition(" ")
    units, _, checkpointed = units.partition(", ")
    base = replace(base, activation_checkpointing=checkpointed == "checkpointed")
    if strategy == "ddp":
        return replace(base, strategy="ddp")
    if strategy == "fsdp":
        if mode == "hybrid" and world_size % 2:
            return None
        return replace(base, strategy="fsdp", sharding=mode, shard_units="model" if units == "one unit" else "blocks")
    pp = min(
        4, world_size, max_stages(base.model_size, base.model)
    )  # a pipeline of up to 4 ranks, the replicas around it
    if world_size % pp:
        return None
    cfg = replace(base, strategy="pippy", schedule=mode, dp=world_size // pp, n_microbatches=max(4, pp))
    return cfg if would_start(cfg, world_size, planned=True) else None  # (a replica's batch its micro-batches split)


def ranks_to_measure(cfg: Config, world_size: int) -> list[int]:
    """DDP's ranks all hold the same; FSDP's first ranks the most (dim-0 chunks are ceil(rows / ranks), the last
    ranks get the rest); a pipeline's ranks hold its different stages (replica 0's)."""
    if cfg.strategy == "ddp":
        return [0]
    if cfg.model == "gpt" and cfg.strategy != "pippy":  # BabyGPT's: rank 0 holds the most (its first rows, TP's
        # equal slices: layout.py checks that TP divides its heads, widths and vocabulary) and runs what any runs
        return [0]
    if cfg.model == "gpt":  # a stage's TP rank 0 speaks for its TP ranks
        return list(range(0, world_size // cfg.dp, cfg.tp))
    if cfg.strategy in ("fsdp", "tp"):  # TP: its ranks hold equal slices; FSDP over --dp, uneven ones
        return sorted({0, world_size - 1})
    return list(range(world_size // cfg.dp))


def textbook(cfg: Config, world_size: int) -> float:
    if cfg.strategy == "tp" or cfg.tp > 1:  # the split parameters over tp and the rest, the others over the rest
        tp = tp_degree(cfg, world_size)
        shares = dict(tp=tp, dp=world_size // tp, optimizer=cfg.optimizer, dataset=cfg.dataset, model=cfg.model)
        theory = tp_state_bytes_theory(cfg.model_size, **shares)
        return theory["param_bytes"] + theory["grad_bytes"] + theory["optim_bytes"]
    shards = {"ddp": 1, "pippy": world_size}.get(cfg.strategy)
    if shards is None:  # FSDP: the ranks one parameter is split over
        shards = {"full": world_size, "grad-op": world_size, "hybrid": world_size // 2, "none": 1}[cfg.sharding]
    params = parameter_count(cfg.model_size, cfg.dataset, cfg.model)
    theory = state_bytes_theory(params, shards=shards, optimizer=cfg.optimizer)
    return theory["param_bytes"] + theory["grad_bytes"] + theory["optim_bytes"]


def unit_bytes(cfg: Config, world_size: int) -> int:
    """The parameters and gradients of the largest unit FSDP gathers whole (fp32) while it runs: an FSDP unit, or
    a pipeline stage sharded over its replicas (--dp)."""
    params = {layer.name: layer.params for layer in layers(cfg.model_size, cfg.dataset, cfg.model)}
    if cfg.strategy == "pippy":
        params = tp_layer_params(cfg.model_size, cfg.tp, cfg.dataset, cfg.model)  # (--tp: a TP rank's part)
        if cfg.dp == 1:
            return 0
        from common.pipeline_layout import PipelineLayout

        names, starts = list(params), PipelineLayout.of(cfg, world_size).stage_starts
        bounds = [names.index(s) for s in starts] + [len(names)]
        return 2 * 4 * int(max(sum(params[n] for n in names[a:b]) for a, b in zip(bounds, bounds[1:])))
    if cfg.strategy == "tp":  # FSDP x TP: a TP rank's part of its largest unit, gathered over the replicas
        units = tp_fsdp_units(cfg.model_size, world_size // cfg.dp, cfg.dataset, cfg.model)
        return 2 * 4 * int(max(units)) if cfg.dp > 1 else 0
    if cfg.strategy not in ("fsdp", "cp") or cfg.sharding == "none":  # (CP: FSDP's unit per block, every rank)
        return 0
    if cfg.shard_units == "model":
        largest = sum(params.values())
    else:  # a unit per block of the model (common/model_sizes.py: blocks)
        largest = max(sum(params[n] for n in block) for block in blocks(cfg.model_size, cfg.model))
    return 2 * 4 * largest


def why_not(variant: str, base: Config, world_size: int) -> str:
    """Why `variant` cannot run on `world_size` ranks, in the scripts' words where they have some."""
    from runner.layout import check_layout

    name, _, mode = variant.partition(",")[0].partition(" ")
    strategy = {"pipeline": "pippy", "fsdp": "tp" if variant.startswith("fsdp x") else "fsdp"}.get(name, name)
    if strategy == "cp":  # cp ranks of a ring, the replicas around them
        cp = int(mode)
        if world_size % cp:
            return f"{cp} CP ranks do not divide the world size {world_size}"
        base = replace(base, dp=world_size // cp, batch_size=max(base.batch_size // cp, 1))
    cfg = replace(base, strategy=strategy, schedule=mode if strategy == "pippy" else base.schedule)
    try:
        replace(cfg).check(world_size=world_size)
        check_layout(cfg, world_size, planned=True)
    except (ConfigError, ValueError) as e:
        return str(e)
    return "its layout needs a number of ranks its parts divide (hybrid: even; TP: one its heads or width allow)"


def time_config(cfg: Config, world_size: int, profile: Profile) -> StepTime:
    """The step of `cfg` on `world_size` ranks on `profile`'s machine, from its planned ranks' counted steps."""
    return predict(cfg, world_size, counted_steps(cfg, world_size), profile)


def counted_steps(cfg: Config, world_size: int) -> dict[int, StepCount]:
    """{rank: its counted step} for the ranks of `cfg` on `world_size` that run different steps."""
    ranks = ranks_to_measure(cfg, world_size)
    return {rank: r.count for rank, r in zip(ranks, measure_ranks([(cfg, world_size)], count=True)[0])}


# A deep BabyGPT is planned at two depths and extrapolated to its own, block by block: its blocks are alike, so what a
# rank holds and runs grows by the same amount with each block it holds (its state, the activations a step keeps, its
# operators' calls, its collectives), which three and four blocks already show (docs/benchmarks, the planner for gpt:
# the extrapolation against plans of every block; with two, a checkpointed block's peak is not yet on the line). A
# pipeline rank's blocks are its stages': one and two a stage (on the line from one). A deep ViT's too, uncounted:
# its state is each parameter's shard or slice summed, a block's the same at any depth (exact); its peak is the largest
# of lines in the blocks (what each moment of the step holds), exact where the line the shallow plans find still is
# the largest at its own depth: checked, not proven (tests/unit/test_planner_speed.py: every variant against plans of
# every block; the 22 B ViT's 27 default plans identical to the byte:
# docs/benchmarks/2026-12-04-zen4-2core-planner-speed.md).
SHALLOW = (3, 4)
SHALLOW_STAGES = (1, 2)


def _extrapolated_ranks(
    cfg: Config, world_size: int, depths: tuple[int, ...], found: dict[tuple[int, int], RankMemory]
) -> list[RankMemory]:
    """Each rank of ranks_to_measure(cfg, world_size) at the model's own depth, from its plans at `depths` (`found`:
    {(rank, depth): its plan there}), on the line through them in the blocks it holds."""
    ranks = ranks_to_measure(cfg, world_size)
    held = []
    for depth in depths:
        with model_depth(cfg.model_size, depth, cfg.model):
            held.append([blocks_held(cfg, world_size, rank) for rank in ranks])
    own = [blocks_held(cfg, world_size, rank) for rank in ranks]
    planned = [[found[rank, depth] for rank in ranks] for depth in depths]
    extrapolated = [_extrapolated(*pair, *blocks) for pair, blocks in zip(zip(*planned), zip(*held, own))]
    if cfg.strategy == "ddp":  # DDP's buckets are not a block's each: laid out again, as DDP lays them
        for rank in (r for r in extrapolated if r.count):
            rank.count.collectives = _ddp_buckets(cfg, rank.count.collectives)
    return extrapolated


def _ddp_buckets(cfg: Config, counted: list[Collective]) -> list[Collective]:
    """`counted`, DDP's bucket all-reduces replaced by those of the model of `cfg`: its gradients in buckets of DDP's
    caps (25 MiB, the first 1 MiB), cut where torch's DDP cuts them, all-reduced in the order the fake step saw."""
    import torch.distributed as dist

    from planner.predict import _model

    params = list(_model(cfg).parameters())  # (on the meta device: shapes alone)
    caps = [dist._DEFAULT_FIRST_BUCKET_BYTES, 25 * 2**20]  # DDP's defaults (torch 2.14.1: _BucketCapacityConfig)
    buckets, _ = dist._compute_bucket_assignment_by_size(params, caps, [False] * len(params))
    sizes = [sum(params[i].numel() * params[i].element_size() for i in bucket) for bucket in reversed(buckets)]
    bucket = next((c for c in counted if not c.logged), None)  # (its group and phase)
    if bucket is None:  # (one rank: nothing is all-reduced)
        return counted
    return [replace(bucket, bytes=n) for n in sizes] + [c for c in counted if c.logged]


def model_depth(size: str, depth: int, model: str = "gpt") -> Any:
    """BabyGPT (or, with model="vit", BabyViT) of `size` with `depth` blocks, for the length of a `with`: its
    shape's depth replaced."""
    from unittest import mock

    if model == "vit":
        from common.vit_sizes import VIT_SIZES

        patch, width, _, heads, mlp = VIT_SIZES[size]
        return mock.patch.dict(VIT_SIZES, {size: (patch, width, depth, heads, mlp)})
    from common.gpt_sizes import GPT_SIZES

    return mock.patch.dict(GPT_SIZES, {size: GPT_SIZES[size]._replace(depth=depth)})


def blocks_held(cfg: Config, world_size: int, rank: int) -> int:
    """The blocks rank `rank` holds: all of them, or a pipeline rank its stages'."""
    if cfg.strategy != "pippy":
        return max_stages(cfg.model_size, cfg.model)  # (a transformer's: its depth)
    from common.pipeline_layout import PipelineLayout

    layout = PipelineLayout.of(cfg, world_size)
    names = [layer.name for layer in layers(cfg.model_size, cfg.dataset, cfg.model)]
    bounds = [names.index(s) for s in layout.stage_starts] + [len(names)]
    mine = layout.stages_of(rank // cfg.tp % layout.pp_size)
    return sum(name.startswith("block") for s in mine for name in names[bounds[s] : bounds[s + 1]])


def shallow_depths(cfg: Config, world_size: int, *, count: bool = False) -> tuple[int, ...]:
    """The two depths a deep BabyGPT or ViT is planned at (SHALLOW, a pipeline's per stage; () for a model no deeper,
    BabyCNN, or a ViT's counted step, planned whole): the second the first where every planned rank holds more
    blocks. (A ViT's counted collectives come out of the line in another order than its own depth runs them; a
    ViT is planned whole too where its two shallow plans would hold as many blocks as it.)"""
    if cfg.model not in ("gpt", "vit") or (cfg.model == "vit" and count):
        return ()
    from common.pipeline_layout import PipelineLayout

    depth = max_stages(cfg.model_size, cfg.model)  # (a transformer's: its depth)
    stages = PipelineLayout.of(cfg, world_size).n_stages if cfg.strategy == "pippy" else 1
    first, second = (stages * n for n in (SHALLOW_STAGES if cfg.strategy == "pippy" else SHALLOW))
    if depth <= second:
        return ()
    ranks = ranks_to_measure(cfg, world_size)
    with model_depth(cfg.model_size, first, cfg.model):
        before = [blocks_held(cfg, world_size, rank) for rank in ranks]
    for deeper in range(second, min(depth, 4 * second)):  # (a heavy head can keep the last stage's blocks)
        if cfg.model == "vit" and first + deeper >= depth:  # (a ViT's two plans only where they cost fewer blocks)
            return ()
        with model_depth(cfg.model_size, deeper, cfg.model):
            if all(blocks_held(cfg, world_size, r) > b for r, b in zip(ranks, before)):
                return first, deeper
    return ()


def _line(a: float, b: float, at: tuple[int, int, int]) -> float:
    """The value at `at[2]` blocks of what is `a` at `at[0]` and `b` at `at[1]`."""
    return b + (b - a) * (at[2] - at[1]) / (at[1] - at[0])


def _extrapolated(shallow: RankMemory, deeper: RankMemory, *blocks: int) -> RankMemory:
    """A rank's plan at `blocks[2]` blocks from its plans at `blocks[0]` (`shallow`) and `blocks[1]` (`deeper`)."""
    whole = lambda name: round(_line(getattr(shallow, name), getattr(deeper, name), blocks))  # noqa: E731
    parts = {k: round(_line(shallow.parts.get(k, 0), v, blocks)) for k, v in deeper.parts.items()}
    count = _extrapolated_count(shallow.count, deeper.count, blocks) if deeper.count else None
    return RankMemory(
        deeper.rank,
        *(whole(name) for name in ("param_bytes", "grad_bytes", "optim_bytes", "peak_bytes")),
        parts=parts,
        in_flight_bytes=deeper.in_flight_bytes,  # (one micro-batch's activation: no block's)
        count=count,
    )


def _extrapolated_count(shallow: StepCount, deeper: StepCount, blocks: tuple[int, int, int]) -> StepCount:
    """A counted step at `blocks[2]` blocks: each kind of operator call, collective and DTensor call as many times
    as the line through the two counts gives. A call whose tensors grow with the blocks (a foreach optimizer's, on
    every parameter) is one call both times: its FLOPs and bytes follow the line instead."""
    from dataclasses import replace as copy

    def loose(key: tuple, op: Any) -> tuple:  # a call's kind, its tensors' shapes as a set
        return op.signature, op.phase, op.action, frozenset(op.shapes)

    exact, by_kind = shallow.ops, {loose(k, op): op for k, op in shallow.ops.items()}
    found = StepCount(fsdp_units=round(_line(shallow.fsdp_units, deeper.fsdp_units, blocks)))
    for key, op in deeper.ops.items():
        if key in exact:
            found.ops[key] = copy(op, calls=round(_line(exact[key].calls, op.calls, blocks)))
        elif (before := by_kind.get(loose(key, op))) is not None and before.calls == op.calls:
            grown = {f: round(_line(getattr(before, f), getattr(op, f), blocks)) for f in ("flops", "bytes")}
            found.ops[key] = copy(op, **grown, fresh_bytes=round(_line(before.fresh_bytes, op.fresh_bytes, blocks)))
        else:
            found.ops[key] = op
    for name, flops in deeper.module_flops.items():
        found.module_flops[name] = round(_line(shallow.module_flops.get(name, flops), flops, blocks))
    for key, calls in deeper.dtensor_calls.items():
        found.dtensor_calls[key] = round(_line(shallow.dtensor_calls.get(key, 0), calls, blocks))
    found.actions = list(deeper.actions)  # (the schedule's: its micro-batches and stages, not their blocks)
    found.collectives = _extrapolated_collectives(shallow.collectives, deeper.collectives, blocks)
    return found


def _extrapolated_collectives(shallow: list[Collective], deeper: list[Collective], blocks: tuple) -> list[Collective]:
    """The collectives of a step at `blocks[2]` blocks, from two counts: of each kind (all but its size alike) as many
    as the line gives, each size as often as the line gives (a block's unit gathered, a block's layer summed); where a
    kind is as many both times, each one's size on the line (what a pipeline stage gathers once a step)."""
    from collections import Counter

    loose = lambda c: replace(c, bytes=0)  # noqa: E731  (`before`, the operators before it, is never compared)
    kinds, sizes, now = Counter(map(loose, shallow)), Counter(shallow), Counter(map(loose, deeper))
    ones = {c: [s for s in shallow if loose(s) == c] for c in kinds}
    more = {c: round(_line(sizes[c], n, blocks)) - n for c, n in Counter(deeper).items()}
    last = {c: i for i, c in enumerate(deeper)}
    found, seen = [], Counter()
    for i, c in enumerate(deeper):
        if kinds[loose(c)] == now[loose(c)]:  # as many both times: its size on the line
            before = ones[loose(c)][seen[loose(c)]]
            seen[loose(c)] += 1
            found.append(replace(c, bytes=round(_line(before.bytes, c.bytes, blocks))))
            continue
        found.append(c)
        if last[c] == i:  # the extra ones after the last of their kind (the step's phases stay in order)
            found += [c] * max(more[c], 0)
    return found


def plan(variant: str, base: Config, world_size: int, *, profile: Profile | None = None) -> Plan | None:
    """`variant` on `world_size` ranks, planned (None where it cannot run); with `profile`, its step's time too."""
    return plan_all([(variant, base, world_size)], profile=profile)[0]


def _empty_plan(variant: str, cfg: Config, world_size: int) -> Plan:
    variant_flags = ("model", "strategy", "sharding", "shard_units", "activation_checkpointing", "schedule", "dp")
    variant_flags += ("tp", "sequence_parallel", "precision") + (("seq_len",) if cfg.model == "gpt" else ())
    flags = {k: v for k, v in cfg.flags().items() if k in variant_flags}
    return Plan(
        variant,
        world_size,
        cfg.model_size,
        cfg.optimizer,
        flags,
        textbook_state_bytes=textbook(cfg, world_size),
        unit_bytes=unit_bytes(cfg, world_size),
        model=cfg.model,
        batch_size=cfg.batch_size,
    )


def plan_all(
    wanted: list[tuple[str, Config, int]],
    *,
    profile: Profile | None = None,
    workers: int = 1,
    started: Callable[[str, int], None] | None = None,
) -> list[Plan | None]:
    """plan(variant, base, world_size) for each of `wanted`, in its order, their ranks measured by `measure_ranks`
    (in `workers` processes); `started(variant, world_size)` as the first rank of a plan starts."""
    configs = [variant_config(variant, base, n) for variant, base, n in wanted]
    named = [(variant, cfg, n) for cfg, (variant, _, n) in zip(configs, wanted) if cfg is not None]
    plans = iter(plan_configs(named, profile=profile, workers=workers, started=started))
    return [None if cfg is None else next(plans) for cfg in configs]


def plan_configs(
    named: list[tuple[str, Config, int]],
    *,
    profile: Profile | None = None,
    workers: int = 1,
    started: Callable[[str, int], None] | None = None,
) -> list[Plan]:
    """Each (name, cfg, world_size) of `named` planned under its name (a variant's, or a published run's), as
    plan_all plans them."""

    def starts(i: int) -> None:
        if started:
            started(named[i][0], named[i][2])

    wanted = [(cfg, n) for _, cfg, n in named]
    ranks = measure_ranks(wanted, count=profile is not None, workers=workers, started=starts)
    plans = []
    for (variant, cfg, n), measured in zip(named, ranks):
        result = _empty_plan(variant, cfg, n)
        result.ranks, result.depths = measured, shallow_depths(cfg, n, count=profile is not None)
        if profile is not None:
            counts = {r.rank: r.count for r in result.ranks if r.count}
            result.time = predict(cfg, n, counts, profile)
        plans.append(result)
    return plans


def measure_ranks(
    wanted: list[tuple[Config, int]],
    *,
    count: bool = False,
    workers: int = 1,
    started: Callable[[int], None] | None = None,
) -> list[list[RankMemory]]:
    """For each (cfg, world_size) of `wanted`: its ranks_to_measure, planned (planner/measure.py's plan_rank, its
    step counted with `count`), each step once (planner/jobs.py: DDP's rank once for every world of more than one,
    a pipeline stage's TP ranks between the first and the last from those two), a deep BabyGPT's or ViT's at two
    shallow depths and extrapolated (`shallow_depths`), in `workers` processes; `started(i)` as the first rank of
    wanted[i] starts."""
    asked: list[dict[tuple[int, int], Job]] = []  # {(rank, depth): the job that measures it}, for each of wanted
    for cfg, n in wanted:
        between = tp_slices(cfg, n, ranks_to_measure(cfg, n), count)
        depths = shallow_depths(cfg, n, count=count) or (0,)  # (0: the model's own depth)
        ranks = [rank for rank in ranks_to_measure(cfg, n) if rank not in between]
        asked.append({(rank, d): Job(cfg, n, rank, count, d) for d in depths for rank in ranks})
    told: set[int] = set()

    def starts(job: Job) -> None:  # (a step several plans share starts them all)
        for i, jobs in enumerate(asked):
            if i not in told and any(j.key == job.key for j in jobs.values()):
                told.add(i)
                if started:
                    started(i)

    found = measure([job for jobs in asked for job in jobs.values()], workers=workers, started=starts)
    more: dict[tuple[int, int, int], Job] = {}  # the ranks between a stage's first and last TP rank, where those
    # differ at any depth planned: measured at each
    for i, (cfg, n) in enumerate(wanted):
        depths = shallow_depths(cfg, n, count=count) or (0,)
        for rank, (first, last) in tp_slices(cfg, n, ranks_to_measure(cfg, n), count).items():
            if not all(same_but_rank(found[asked[i][first, d].key], found[asked[i][last, d].key]) for d in depths):
                more |= {(i, rank, d): Job(cfg, n, rank, count, d) for d in depths}
    found |= measure(list(more.values()), workers=workers)
    measured = []
    for i, (cfg, n) in enumerate(wanted):
        depths = shallow_depths(cfg, n, count=count)
        jobs = dict(asked[i])
        for rank, (first, _) in tp_slices(cfg, n, ranks_to_measure(cfg, n), count).items():
            jobs |= {(rank, d): more.get((i, rank, d)) or jobs[first, d] for d in depths or (0,)}
        ranks = {k: replace(found[job.key], rank=k[0]) for k, job in jobs.items()}
        if depths:
            measured.append(_extrapolated_ranks(cfg, n, depths, ranks))
        else:
            measured.append([ranks[rank, 0] for rank in ranks_to_measure(cfg, n)])
    return measured
