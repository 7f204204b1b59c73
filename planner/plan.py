"""What to plan, and the textbook beside it: the strategy variants a plan covers, each one's layout at a world size,
the ranks worth measuring, and the textbook's bytes per rank with what the measurement adds to them."""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

from common.config import Config
from common.errors import ConfigError
from common.model_sizes import blocks, layers, max_stages, parameter_count, tp_degree, tp_fsdp_units, tp_layer_params
from planner.count import StepCount
from planner.jobs import Job, measure, same_but_rank, tp_slices
from planner.measure import RankMemory, plan_rank
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
    return replace(base, strategy="pippy", schedule=mode, dp=world_size // pp, n_microbatches=max(4, pp))


def ranks_to_measure(cfg: Config, world_size: int) -> list[int]:
    """DDP's ranks all hold the same; FSDP's first ranks the most (dim-0 chunks are ceil(rows / ranks), the last
    ranks get the rest); a pipeline's ranks hold its different stages (replica 0's)."""
    if cfg.strategy == "ddp":
        return [0]
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
    if cfg.strategy != "fsdp" or cfg.sharding == "none":
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
    return {rank: plan_rank(cfg, world_size, rank, count=True).count for rank in ranks_to_measure(cfg, world_size)}


def plan(variant: str, base: Config, world_size: int, *, profile: Profile | None = None) -> Plan | None:
    """`variant` on `world_size` ranks, planned (None where it cannot run); with `profile`, its step's time too."""
    return plan_all([(variant, base, world_size)], profile=profile)[0]


def _empty_plan(variant: str, cfg: Config, world_size: int) -> Plan:
    variant_flags = ("model", "strategy", "sharding", "shard_units", "activation_checkpointing", "schedule", "dp")
    variant_flags += ("tp", "sequence_parallel")
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
    feasible = [(cfg, n) for cfg, (_, _, n) in zip(configs, wanted) if cfg is not None]
    told = [(variant, n) for cfg, (variant, _, n) in zip(configs, wanted) if cfg is not None]

    def starts(i: int) -> None:
        if started:
            started(*told[i])

    ranks = iter(measure_ranks(feasible, count=profile is not None, workers=workers, started=starts))
    plans: list[Plan | None] = []
    for (variant, _, n), cfg in zip(wanted, configs):
        if cfg is None:
            plans.append(None)
            continue
        result = _empty_plan(variant, cfg, n)
        result.ranks = next(ranks)
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
    a pipeline stage's TP ranks between the first and the last from those two), in `workers` processes; `started(i)`
    as the first rank of wanted[i] starts."""
    asked: list[dict[int, Job]] = []  # {rank: the job that measures it}, for each of wanted
    for cfg, n in wanted:
        between = tp_slices(cfg, n, ranks_to_measure(cfg, n), count)
        asked.append({rank: Job(cfg, n, rank, count) for rank in ranks_to_measure(cfg, n) if rank not in between})
    told: set[int] = set()

    def starts(job: Job) -> None:  # (a step several plans share starts them all)
        for i, jobs in enumerate(asked):
            if i not in told and any(j.key == job.key for j in jobs.values()):
                told.add(i)
                if started:
                    started(i)

    found = measure([job for jobs in asked for job in jobs.values()], workers=workers, started=starts)
    more: dict[tuple[int, int], Job] = {}  # the ranks between a stage's first and last TP rank, where those differ
    for i, (cfg, n) in enumerate(wanted):
        for rank, (first, last) in tp_slices(cfg, n, ranks_to_measure(cfg, n), count).items():
            if not same_but_rank(found[asked[i][first].key], found[asked[i][last].key]):
                more[i, rank] = Job(cfg, n, rank, count)
    found |= measure(list(more.values()), workers=workers)
    measured = []
    for i, (cfg, n) in enumerate(wanted):
        between = tp_slices(cfg, n, ranks_to_measure(cfg, n), count)
        jobs = {**asked[i], **{rank: more.get((i, rank)) or asked[i][first] for rank, (first, _) in between.items()}}
        measured.append([replace(found[jobs[rank].key], rank=rank) for rank in ranks_to_measure(cfg, n)])
    return measured
