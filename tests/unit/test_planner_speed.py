"""The planner's shortcuts (planner/shortcuts.py, planner/jobs.py) hand back what planning every rank the long way
hands back: FSDP's chunks made one at a time are torch.chunk's; a plan with the shortcuts taken holds the figures of
the same plan with them off; a pipeline stage's TP ranks between the first and the last are what measuring them
gives; DDP's rank is measured once for the worlds of more than one rank; worker processes plan what this one does."""

from __future__ import annotations

import pytest
import torch

from common.config import Config
from common.versions import NEEDS_PLANNER
from tests.helpers import needs_torch

pytestmark = needs_torch(NEEDS_PLANNER)


@pytest.mark.parametrize("rows, n", [(10, 4), (9, 4), (5, 4), (1, 8), (0, 3), (1024, 1024), (1000, 1024), (6, 1)])
def test_fsdp_chunks_made_one_at_a_time_are_torch_chunks(rows: int, n: int) -> None:
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    from planner.shortcuts import _Chunks

    for dim, tensor in ((0, torch.arange(rows * 3.0).view(rows, 3)), (1, torch.arange(rows * 2.0).view(2, rows))):
        expected, lazy = _chunk_with_empty(tensor, n, dim=dim), _Chunks(tensor, n, dim)
        assert len(lazy) == len(expected) == n
        for i in [*range(n), -1]:
            a, b = expected[i], lazy[i]
            assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), (rows, n, dim, i)
            if a.numel():  # a view of the tensor, where torch's is: the same storage, offset and values
                assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                assert a.storage_offset() == b.storage_offset() and torch.equal(a, b)


def plan_all(wanted: list[tuple[str, Config, int]], **kw):  # type: ignore[no-untyped-def]
    from planner.plan import plan_all

    return [p.to_json() if p else None for p in plan_all(wanted, **kw)]


def baby(model: str, n: int) -> Config:
    return Config(model=model, model_size="baby", batch_size=32 * n)


def test_a_plan_with_the_shortcuts_holds_the_figures_of_the_plan_without(monkeypatch) -> None:
    """BabyCNN's FSDP x TP on 16 ranks, 8-way TP and FSDP over 2 replicas (FSDP's chunks, _StridedShard specs,
    DTensor's state), its last rank's layouts those its first worked out; the same plan with the shortcuts off."""
    from planner import shortcuts

    wanted = [("fsdp x tp", baby("cnn", 16), 16)]
    shortcuts.USED.clear()
    fast = plan_all(wanted)
    used = dict(shortcuts.USED)
    assert all(used.get(k, 0) > 0 for k in ("fsdp chunks", "strided flag", "layouts kept", "local parts")), used
    monkeypatch.setattr(shortcuts, "ON", False)
    shortcuts.USED.clear()
    slow = plan_all(wanted)
    assert not shortcuts.USED and fast == slow
    assert fast[0]["flags"]["dp"] == 2 and [r["rank"] for r in fast[0]["ranks"]] == [0, 15]


def test_a_stages_tp_ranks_between_its_first_and_last_are_what_measuring_them_gives() -> None:
    """The ViT on 8 ranks: 2 stages x 4 TP ranks (its 4 heads), each stage's middle two ranks not measured."""
    from planner import jobs
    from planner.jobs import tp_slices
    from planner.measure import plan_rank
    from planner.plan import ranks_to_measure, variant_config

    cfg = variant_config("fsdp x pp x tp", baby("vit", 8), 8)
    assert (cfg.tp, cfg.dp) == (4, 1)
    ranks = ranks_to_measure(cfg, 8)
    assert tp_slices(cfg, 8, ranks, False) == {1: (0, 3), 2: (0, 3), 5: (4, 7), 6: (4, 7)}
    assert tp_slices(cfg, 8, ranks, True) == {}  # counted: each rank's count names its own groups
    measured: list[int] = []
    original = jobs._measure
    jobs._measure = lambda job: measured.append(job.rank) or original(job)
    try:
        [planned] = plan_all([("fsdp x pp x tp", baby("vit", 8), 8)])
    finally:
        jobs._measure = original
    assert measured == [0, 3, 4, 7] and [r["rank"] for r in planned["ranks"]] == ranks
    assert planned["ranks"][1] == {**plan_rank(cfg, 8, 1).__dict__, "count": None}  # a stand-in: as measured
    assert planned["ranks"][1]["peak_bytes"] != planned["ranks"][6]["peak_bytes"]  # (two stages, two steps)


def test_a_stages_tp_ranks_that_differ_are_each_measured() -> None:
    """Where a stage's first and last TP rank hold different figures, the ranks between are measured too: the
    measurement here is a stand-in whose last TP rank of the second stage peaks a byte higher (the ViT's splits are
    even, and its ranks hold the same)."""
    from planner import jobs
    from planner.measure import RankMemory
    from planner.plan import measure_ranks, variant_config

    cfg = variant_config("fsdp x pp x tp", baby("vit", 8), 8)
    measured: list[int] = []
    original = jobs._measure
    jobs._measure = lambda job: measured.append(job.rank) or RankMemory(job.rank, 1, 1, 2, 9 + (job.rank == 7))
    try:
        [ranks] = measure_ranks([(cfg, 8)])
    finally:
        jobs._measure = original
    assert measured == [0, 3, 4, 7, 5, 6] and [r.rank for r in ranks] == list(range(8))
    assert [r.peak_bytes for r in ranks] == [9] * 7 + [10]


def test_ddp_is_measured_once_for_the_worlds_of_more_than_one_rank() -> None:
    from planner import jobs
    from planner.measure import plan_rank
    from planner.plan import variant_config

    measured: list[int] = []
    original = jobs._measure
    jobs._measure = lambda job: measured.append(job.world_size) or original(job)
    try:
        planned = plan_all([("ddp", baby("cnn", n), n) for n in (1, 4, 64)])
    finally:
        jobs._measure = original
    assert measured == [1, 4]
    cfg = variant_config("ddp", baby("cnn", 64), 64)
    assert planned[2]["ranks"] == [{**plan_rank(cfg, 64, 0).__dict__, "count": None}]
    assert planned[2]["world_size"] == 64 and planned[1]["ranks"] == planned[2]["ranks"]


def test_worker_processes_plan_what_this_one_does() -> None:
    from planner.timing import load_profile

    wanted = [("ddp", baby("cnn", 2), 2), ("pipeline 1f1b", baby("cnn", 2), 2)]
    h100 = load_profile("h100-sxm")
    started: list = []
    here = plan_all(wanted, profile=h100)
    there = plan_all(wanted, profile=h100, workers=2, started=lambda v, n: started.append((v, n)))
    assert here == there and sorted(started) == sorted((v, n) for v, _, n in wanted)
    assert there[1]["time"]["step_s"] > 0 and there[1]["ranks"][1]["count"]["actions"]  # (counted: pickled back)


def deep_vit_plans(variant: str, n: int, depth: int) -> tuple[tuple[int, ...], list, list]:
    """The ViT baby made `depth` blocks deep, `variant` on `n` ranks: the depths it is planned at, its ranks as the
    planner plans them (at those depths, extrapolated), and each rank planned at every block."""
    from planner.measure import plan_rank
    from planner.plan import measure_ranks, model_depth, ranks_to_measure, shallow_depths, variant_config

    with model_depth("baby", depth, "vit"):
        cfg = variant_config(variant, baby("vit", n), n)
        whole = [plan_rank(cfg, n, rank) for rank in ranks_to_measure(cfg, n)]
        return shallow_depths(cfg, n), measure_ranks([(cfg, n)])[0], whole


VIT_WORLDS = [  # (a pipeline of 4 stages is planned at 1 and 2 blocks a stage: 13 blocks, cut 4, 3, 3, 3)
    *(("fsdp full, a unit per block, checkpointed", 8, 12), ("fsdp x tp, sequence parallel", 8, 12)),
    *(pytest.param(v, n, 12, marks=pytest.mark.heavy) for v in ("ddp", "fsdp full, a unit per block") for n in (1, 8)),
    *(pytest.param("fsdp x tp", n, 12, marks=pytest.mark.heavy) for n in (4, 8)),
    *(pytest.param("pipeline 1f1b", n, 13, marks=pytest.mark.heavy) for n in (4, 8)),
    *(pytest.param("fsdp x pp x tp", n, d, marks=pytest.mark.heavy) for n, d in ((4, 12), (8, 12), (16, 13))),
]


@pytest.mark.parametrize("variant, n, depth", VIT_WORLDS)
def test_a_deep_vits_plan_from_two_shallow_depths_is_the_plan_of_every_block(variant: str, n: int, depth: int) -> None:
    """The ViT baby made 12 or 13 blocks deep, planned at 3 and 4 blocks (a pipeline at 1 and 2 a stage) and
    extrapolated in the blocks each rank holds: every rank's state, peak and parts those of planning every block, to
    the byte (FSDP's uneven chunks of the head on 8 ranks, TP's slices, a pipeline's uneven stages, a stage's middle
    TP ranks at 8 and 16)."""
    depths, found, whole = deep_vit_plans(variant, n, depth)
    assert depths and depths[0] + depths[1] < depth
    assert [r.__dict__ for r in found] == [r.__dict__ for r in whole]


def test_a_vit_is_planned_whole_where_counted_or_where_two_shallow_plans_hold_as_many_blocks() -> None:
    from planner.plan import model_depth, shallow_depths, variant_config

    cfg = variant_config("fsdp full, a unit per block", baby("vit", 8), 8)
    assert shallow_depths(cfg, 8) == ()  # (the baby's 6 blocks: 3 and 4 are more)
    with model_depth("baby", 12, "vit"):
        assert shallow_depths(cfg, 8) == (3, 4) and shallow_depths(cfg, 8, count=True) == ()
