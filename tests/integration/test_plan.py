"""The memory planner against real runs: at the trainable sizes (BabyCNN's and the ViT's `baby`) at 1 to 4
processes, every rank of a DDP, an FSDP (a unit per layer), a 1F1B, a TP and an FSDP x TP run holds exactly the state
bytes the planner says (run.json's param, grad and optimizer bytes), and its measured peak (--measure-peak, the
launch's second step) is within 2 % of the planned one (FSDP's within 15 %: when a real collective lets go of its
buffers is timing; a pipeline rank's, of the planned range: gloo may still hold the activation it sent), counted from
its tensors, and within 20 % as the C allocator itself saw it. The same planned steps, counted (planner/count.py), do
the model's FLOPs by its sizes and move the bytes planner/predict.py predicts, per rank and kind of collective, for
every strategy and mode. The same checks at the larger sizes (12.7 M and 201.6 M parameters) are the heavy tier's:
test_plan_sizes.py. The steps the selected tests plan are planned ahead, in a background process
(tests/integration/plans_ahead.py)."""

import json
import sys
from collections import Counter
from pathlib import Path

import pytest

from common.cli import parse_config
from common.config import Config
from common.model_sizes import blocks
from common.versions import NEEDS_PLANNER
from planner.count import DTENSOR_CALL
from planner.plan import VIT_VARIANTS, plan, ranks_to_measure, variant_config
from planner.predict import analytic_flops, traffic
from planner.report import largest_batch
from runner.memory import planned_peak_bytes
from tests.helpers import SMALL, Run, needs_torch, read_run, run_command
from tests.integration.early import Command
from tests.integration.plans_ahead import Planned, Plans

pytestmark = needs_torch(NEEDS_PLANNER)  # every test here plans

# {name: (strategy, flags, process counts)}
VARIANTS = {
    "ddp": ("ddp", [], (1, 2, 3, 4)),
    "fsdp": ("fsdp", ["--shard-units", "blocks"], (1, 2, 3, 4)),
    "pippy": ("pippy", ["--n-microbatches", "4"], (1, 2, 3, 4)),
    "tp": ("tp", [], (1, 2, 4)),  # 3 ranks cannot split a width of 128 or 1024
    "fsdp-x-tp": ("tp", ["--dp", "2"], (2, 4)),
    # BabyViT: a unit per block, each block checkpointed or not, the pipeline cut between blocks
    "vit-ddp": ("ddp", ["--model", "vit"], (1, 2, 4)),
    "vit-fsdp": ("fsdp", ["--model", "vit", "--shard-units", "blocks"], (1, 2, 4)),
    "vit-fsdp-ac": ("fsdp", ["--model", "vit", "--shard-units", "blocks", "--activation-checkpointing"], (1, 2, 4)),
    "vit-pippy": ("pippy", ["--model", "vit", "--n-microbatches", "4"], (1, 2, 4)),
}
# A real run's peak, counted from its tensors, against the plan at `baby`: ~10x the 0.21 % measured at most where the
# count is the same bytes every run (DDP, TP, the pipelines; TP's within 0.03 %; 2-core AMD EPYC Zen 4, torch 2.14.1,
# 2026-12-03, three runs of each)
PEAK_TOLERANCE = 0.02
# but for one rank, also the same every run: the last of BabyCNN's 4 pipeline stages peaked 8.8 % below its plan
# (931,976 bytes against 1,022,088)
PEAK_TOLERANCE_OF = {("pippy", 4, 3): 0.1}
# FSDP's runs peak where a real collective lets go of its buffers, later than a fake one, by timing: BabyCNN's, a unit
# per layer on 3 ranks, peaked 10.7 % above its plan on rank 2 in one run of three, 0.04 % in the others (the same
# machine and day). The heavy tier's sizes (test_plan_sizes.py, not measured again) keep it for every variant: at
# `small` FSDP and FSDP x TP peaked up to 11 % above (docs/memory.md).
FSDP_VARIANTS = ("fsdp", "fsdp-x-tp", "vit-fsdp", "vit-fsdp-ac")
TIMED_PEAK_TOLERANCE = 0.15
# the C allocator's own count (glibc's bytes in use, run.json's allocator_peak_bytes) also holds what torch's kernels
# allocate for themselves, which no tensor shows, and a pipeline stage's gloo buffers may be gone before the count's
# peak: measured within 0.836 (the third of BabyCNN's 4 stages) to 1.035 (DDP) of the planned range at `baby` (the
# same machine and day), 0.87 to 1.15 with the heavy tier's sizes (2026-11-24)
ALLOCATOR_TOLERANCE = 0.2
# the memory wall's closed form (runner/memory.py: the preflight cannot plan with torch) against the planner
CLOSED_FORM_TOLERANCE = 0.25
WALL_VARIANTS = (
    "ddp",
    "fsdp full, a unit per layer",
    "fsdp full, one unit",
    "fsdp grad-op, a unit per layer",
    "pipeline 1f1b",
    "fsdp x tp",
)


def flags(size: str, variant: str, nproc: int) -> list[str]:
    per_rank = 2 if size == "medium" else 32  # as a default 4-process run (a pipeline: 32 per stage); 201 M: 2
    batch = ["--batch-size", str(per_rank * nproc)]
    # (201 M evaluates 16 test images, not 256: 8 s of its run, and the peak is the training step's)
    test = ["--test-size", "16"] if size == "medium" else []
    return [*SMALL, *test, *batch, "--model-size", size, "--dropout", "0", "--max-steps", "2", "--measure-peak"] + [
        *VARIANTS[variant][1]
    ]


def pooled(planned: dict[tuple[str, str], tuple[int, ...]]) -> dict[str, Run]:
    """The real runs of {(size, variant): process counts}, named size-variant-nproc."""
    return {
        f"{size}-{variant}-{nproc}": Run(VARIANTS[variant][0], flags(size, variant, nproc), nproc=nproc)
        for (size, variant), nprocs in planned.items()
        for nproc in nprocs
    }


def counted(planned: dict[tuple[str, str], tuple[int, ...]]) -> dict[str, tuple[str, list[str], int]]:
    """The same runs' steps, to count: {name: (strategy, flags, ranks)}."""
    return {f"{s}-{v}-{n}": (VARIANTS[v][0], flags(s, v, n), n) for (s, v), ns in planned.items() for n in ns}


# {(size, variant): process counts}: every variant at the trainable size
PLANNED = {("baby", v): VARIANTS[v][2] for v in VARIANTS}
POOLED = pooled(PLANNED)


@pytest.mark.parametrize("size, variant", PLANNED)
def test_the_plan_is_what_each_rank_of_a_real_run_holds(plans, pool, size, variant):
    check_real_runs(plans, pool / "plan", size, variant, PLANNED[size, variant])


def real_run_plans(size: str, variant: str, nprocs: tuple[int, ...]) -> list[Planned]:
    """Every rank of each real run: run.json holds every rank's memory."""
    cfgs = {n: parse_config(VARIANTS[variant][0], flags(size, variant, n), world_size=n) for n in nprocs}
    return [Planned(cfgs[n], n, rank, count=False) for n in nprocs for rank in range(n)]


def check_real_runs(plans: Plans, runs: Path, size: str, variant: str, nprocs: tuple[int, ...]) -> None:
    for p in real_run_plans(size, variant, nprocs):
        run = read_run(runs / f"{size}-{variant}-{p.world_size}")
        assert run["memory"]["peak"]["step"] == 2
        measured, planned = run["memory"]["per_rank"][p.rank], plans.of(p)
        where = f"{size} {variant} on {p.world_size}, rank {p.rank}"
        assert measured["rank"] == p.rank, where
        # the state, byte for byte: the same wrap and optimizer, counted by the same function
        assert (planned.param_bytes, planned.grad_bytes, planned.optim_bytes) == (
            measured["param_bytes"],
            measured["grad_bytes"],
            measured["optim_bytes"],
        ), where
        # the peak of a step: the same count over a fake step and a real one, within 2 % at `baby` but for FSDP's
        # (peak_tolerance); a pipeline rank's, of the range its backend's timing allows (a sent activation held, or
        # already let go)
        low, high = planned.peak_bytes, planned.peak_bytes + planned.in_flight_bytes
        peak, within = measured["peak_bytes"], peak_tolerance(size, variant, p.world_size, p.rank)
        assert (1 - within) * low <= peak <= (1 + within) * high, (where, low, high, peak)
        # and the memory the process really used: the peak as the C allocator saw it, not counted from tensors
        used = measured["allocator_peak_bytes"]
        assert (1 - ALLOCATOR_TOLERANCE) * low <= used <= (1 + ALLOCATOR_TOLERANCE) * high, (where, low, high, used)


def peak_tolerance(size: str, variant: str, world_size: int, rank: int) -> float:
    """How far a real run's peak may be from its plan, a fraction of it."""
    if size != "baby" or variant in FSDP_VARIANTS:
        return TIMED_PEAK_TOLERANCE
    return PEAK_TOLERANCE_OF.get((variant, world_size, rank), PEAK_TOLERANCE)


# Beyond the real runs' configurations, every other mode whose collectives differ: {name: (strategy, flags, ranks)}
COUNTED = {
    "fsdp-grad-op": ("fsdp", ["--sharding", "grad-op"], 2),
    "fsdp-ac": ("fsdp", ["--activation-checkpointing"], 2),  # BabyCNN checkpointed whole
    "fsdp-hybrid": ("fsdp", ["--sharding", "hybrid", "--shard-units", "blocks", "--model-size", "small"], 4),
    "pippy-zbv": ("pippy", ["--schedule", "zbv", "--stages-per-rank", "2"], 2),
    "pippy-dp": ("pippy", ["--dp", "2", "--n-microbatches", "2"], 4),
    "vit-tp-sp": ("tp", ["--model", "vit", "--sequence-parallel"], 2),
    "vit-pp-x-tp": ("pippy", ["--model", "vit", "--tp", "2"], 4),  # the 3-D mesh at dp 1
}
COUNTED |= counted(PLANNED)


@pytest.mark.parametrize("name", COUNTED)
def test_the_planned_step_does_the_models_flops_and_moves_the_predicted_bytes(plans, name):
    check_count(plans, name, *COUNTED[name])


def counted_plans(strategy: str, given: list[str], n: int) -> list[Planned]:
    cfg = parse_config(strategy, given, world_size=n)
    return [Planned(cfg, n, rank) for rank in ranks_to_measure(cfg, n)]


def check_count(plans: Plans, name: str, strategy: str, given: list[str], n: int) -> None:
    for p in counted_plans(strategy, given, n):
        cfg, rank, count = p.cfg, p.rank, plans.of(p).count
        where = f"{name}, rank {rank}"
        # per kind of collective, the bytes of the step the fake group saw are those the model and mesh predict
        assert count.collective_bytes() == {k: v["bytes"] for k, v in traffic(cfg, n, rank).items()}, where
        # each collective holds what its rank ran since the one before it (the compute a CPU collective's cost after
        # compute is read at): operators of the count, each call in at most one collective's, DTensor's calls too
        since: Counter = Counter()
        for c in count.collectives:
            since.update(dict(c.before))
        ops = [k for k in since if k != DTENSOR_CALL]
        assert all(k in count.ops and since[k] <= count.ops[k].calls for k in ops), where
        assert bool(ops) == bool(count.collectives), where  # (one process: no collective, nothing between them)
        assert since[DTENSOR_CALL] <= sum(count.dtensor_calls.values()), where
        # the FLOPs of its operators, as torch's formulas count them, are the model's by its sizes; a checkpointed
        # block's forward runs again in backward
        model = analytic_flops(cfg, n, rank)
        assert count.flops("forward") == model["forward"], where
        assert count.flops("backward") == model["backward"] + model["recomputed"], where
        # where they ran: DDP's all-reduces and FSDP's reduce-scatters in backward, FSDP's gathers before each
        # unit's forward (and again before its backward); the single numbers (the loss, the gradient norm) after
        phases = {(c.kind, c.phase) for c in count.collectives if not c.logged}
        # TP's layers run as DTensors: each call is counted apart, as its dispatch costs time of its own (FSDP's
        # only in its optimizer and gradient norm, on sharded parameters); FSDP's units are the ones it wrapped
        layer_calls = sum(n for (phase, _), n in count.dtensor_calls.items() if phase != "optimizer")
        assert (layer_calls > 0) == (strategy == "tp" or cfg.tp > 1), where
        if strategy == "ddp":
            assert not count.dtensor_calls and not count.fsdp_units, where
        if strategy == "fsdp":
            units = len(blocks(cfg.model_size, cfg.model)) if cfg.shard_units == "blocks" else 0
            assert count.dtensor_calls["optimizer", ""] > 0 and count.fsdp_units == units + 1, where
        if strategy in ("ddp", "fsdp"):
            assert {p for k, p in phases if k in ("all_reduce", "reduce_scatter")} <= {"backward"}, where
            assert {p for k, p in phases if k == "all_gather"} <= {"forward", "backward"}, where


@pytest.mark.parametrize("model", ("cnn", "vit"))
def test_the_closed_form_is_within_25_percent_of_the_planner(plans, model):
    check_closed_form(plans, model, "baby")


def closed_form_plans(model: str, size: str) -> dict[tuple[str, int], list[Planned]]:
    """{(variant, world size): its ranks to plan}"""
    found = {}
    for variant in VIT_VARIANTS if model == "vit" else WALL_VARIANTS:
        # the CNN on 1 process, on 3 (shards and batches that do not divide) and on 4; the ViT on 2 and, fake 200 M
        # (seconds a plan), on 4
        for n in (1, 3, 4) if model == "cnn" else (2,) if size == "baby" else (4,):
            cfg = variant_config(variant, Config(model=model, model_size=size, batch_size=32 * n), n)
            if cfg is not None:  # (FSDP x TP on 3 ranks: no TP degree splits a width of 2^k)
                found[variant, n] = [Planned(cfg, n, rank, count=False) for rank in ranks_to_measure(cfg, n)]
    return found


def check_closed_form(plans: Plans, model: str, size: str) -> None:
    for (variant, n), ranks in closed_form_plans(model, size).items():
        planned = max(plans.of(p).peak_bytes for p in ranks)
        closed = planned_peak_bytes(ranks[0].cfg, n)
        assert abs(closed - planned) <= CLOSED_FORM_TOLERANCE * planned, (size, variant, n, closed, planned)


def test_the_largest_batch_is_planned_to_fit_and_the_next_one_up_not(plans):
    # a step's peak is not a straight line in the batch: the answer is a batch the search planned and saw fit, and
    # the next batch the variant can run (a pipeline of 2 stages and 4 micro-batches: even ones) planned and seen
    # not to; each planned again here on its own
    memory = 60 * 10**6
    for variant, n, step in (("ddp", 1, 1), ("fsdp full, a unit per layer", 4, 1), ("pipeline 1f1b", 2, 2)):
        found = largest_batch(plan(variant, Config(batch_size=32 * n), n), memory, start=32)
        assert found is not None and 32 < found.fits and found.over == found.fits + step, (variant, found)
        for per_rank, fits in ((found.fits, True), (found.over, False)):
            cfg = variant_config(variant, Config(batch_size=per_rank * n), n)
            ranks = [plans.of(Planned(cfg, n, rank, count=False)) for rank in ranks_to_measure(cfg, n)]
            worst = max(r.peak_bytes + r.in_flight_bytes for r in ranks)
            assert (worst <= memory) == fits and worst in (found.fits_bytes, found.over_bytes), (variant, per_rank)


def planned_by(item: pytest.Item) -> list[Planned]:
    """The steps a selected test of this module (or test_plan_sizes.py) will plan, planned ahead by tests/conftest.py;
    the largest batch's are found by its search, in the test."""
    name, params = item.originalname, getattr(getattr(item, "callspec", None), "params", {})
    if name == test_the_plan_is_what_each_rank_of_a_real_run_holds.__name__:
        size, variant = params["size"], params["variant"]
        return real_run_plans(size, variant, item.module.PLANNED[size, variant])
    if name == test_the_planned_step_does_the_models_flops_and_moves_the_predicted_bytes.__name__:
        return counted_plans(*item.module.COUNTED[params["name"]])
    if name == test_the_closed_form_is_within_25_percent_of_the_planner.__name__:
        return [p for ranks in closed_form_plans(params["model"], params.get("size", "baby")).values() for p in ranks]
    return []


# started with the session (tests/integration/early.py): the planner as a user runs it
STARTED = {
    "7b": Command(
        [sys.executable, "-m", "planner", "--model-size", "7b", "--world-sizes", "4", "--json", "{out}/7b.json"]
    )
}


def test_the_planner_command_for_7b_on_4_ranks(early):
    # what the README promises of 7 B: DDP's and FSDP x 4's state per rank next to the textbook's 112 and 28 GB
    # (this model has 7.13 B parameters: 114.1 and 28.5 GB), and the peak beside them; FSDP gathering the whole
    # model as one unit peaks far above a unit per layer
    out, stdout = early.finished("plan/7b")
    plans = {p["variant"]: p for p in json.loads((out / "7b.json").read_text())}
    n = 7_131_015_562
    ddp, per_layer, whole = (
        plans[v]["ranks"][0] for v in ("ddp", "fsdp full, a unit per layer", "fsdp full, one unit")
    )
    assert ddp["param_bytes"] + ddp["grad_bytes"] == 8 * n and 8 * n <= ddp["optim_bytes"] <= 8 * n + 4 * 64
    assert abs(per_layer["param_bytes"] - 4 * n / 4) < 1e6  # a quarter, but for the padding of uneven rows
    assert plans["fsdp full, a unit per layer"]["textbook_state_bytes"] == 16 * n / 4
    assert whole["peak_bytes"] > 2 * per_layer["peak_bytes"] > per_layer["param_bytes"] + per_layer["optim_bytes"]
    assert "| ddp | 4 | 28.52 GB | 28.52 GB | 57.05 GB | 114.10 GB | 114.10 GB |" in stdout


def test_the_runner_refuses_a_model_that_does_not_fit_before_torchrun_starts(tmp_path):
    # 7b with DDP needs ~115 GB per process: on any machine this suite runs on, one line, exit 2, nothing started
    out = tmp_path / "too-big"
    proc = run_command(["bash", "run_ddp.sh", "--model-size", "7b", "--out", str(out)], check=False, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("error: --model-size 7b: DDP on 4 ranks needs 4 processes x ~115.0 GB")
    assert len(proc.stderr.strip().splitlines()) == 1 and not out.exists()
