"""The collectives on real processes (gloo): the hand-written ring all-reduce against dist.all_reduce and inside
DDP, and each strategy's traffic per step, predicted by the planner (planner/predict.py), against what the
profiler saw, with gradient accumulation too (the reductions once per optimizer step)."""

import json

import pytest

from bench.collectives import OPS
from common.cli import parse_config
from planner.predict import traffic
from tests.helpers import PARITY, SMALL, Run, assert_follows, losses, read_run

RING_STEPS = 10
# one step profiled, the third: DDP's second step also broadcasts its rebuilt bucket layout, the pipeline's first
# infers the activations' shapes
TRAFFIC = [*SMALL, "--max-steps", "3", "--batch-size", "32", "--profile-steps", "3:3"]
# {name: (strategy, flags, processes)}: the ViT's one-dimensional layouts on 2 (its TP step costs ~3x as much on 4
# processes as on 2 here; the degree is a parameter of the prediction, the other layouts check it at 4)
TRAFFIC_RUNS = {
    "ddp": ("ddp", [], 4),
    "fsdp-full": ("fsdp", ["--shard-units", "blocks"], 4),  # the features resharded after forward: gathered twice
    "fsdp-hybrid": ("fsdp", ["--sharding", "hybrid"], 4),  # + the shards' all-reduce over the 2 replicas
    "pp-1f1b": ("pippy", [], 4),
    "fsdp-x-tp": ("tp", ["--dp", "2"], 4),  # TP's all-reduces and FSDP over "dp"
    "vit-fsdp": ("fsdp", ["--model", "vit"], 2),  # a unit per block
    "vit-tp": ("tp", ["--model", "vit"], 2),  # per block: proj's and fc2's outputs, q's, k's, v's and fc1's inputs
    # per block: the tokens gathered before attention and MLP, proj's and fc2's sums reduce-scattered (and the
    # reverse in backward), the norms' gradients all-reduced; the cut after the embedding, the head's gather
    "vit-tp-sp": ("tp", ["--model", "vit", "--sequence-parallel"], 2),
    "vit-fsdp-x-tp-sp": ("tp", ["--model", "vit", "--sequence-parallel", "--dp", "2"], 4),
}
ACCUMULATE = ["--grad-accum-steps", "4"]  # TRAFFIC's 32 samples: chunks of 2 per rank, of 4 per FSDP x TP replica
# {TRAFFIC_RUNS name: (what reduces the gradients, what each accumulation chunk runs again)}, run again with
# ACCUMULATE: the reductions once per optimizer step (their calls and elements those of the run without it), the
# FSDP units' all-gathers before every chunk's forward and backward, and TP's all-reduces of every chunk's activations
ACCUMULATED = {
    "ddp": (["all_reduce"], []),  # a bucket's all-reduce on the last chunk's backward only (no_sync before it)
    "fsdp-full": (["reduce_scatter"], ["all_gather"]),
    "fsdp-hybrid": (["reduce_scatter", "all_reduce"], ["all_gather"]),  # the all-reduce: over the 2 replicas
    "fsdp-x-tp": (["reduce_scatter"], ["all_gather", "all_reduce"]),  # the reduce-scatter: over "dp"
}

POOLED = {
    # (a ring of 2 is either world's even ranks, the sub-group each checks)
    **{f"ring{n}": Run("ring", nproc=n) for n in (3, 4)},
    # two profiled steps each: which collectives carried the gradients
    "builtin": Run("ddp", [*PARITY, "--max-steps", str(RING_STEPS), "--profile-steps", "3:4"]),
    "ring": Run("ddp", [*PARITY, "--max-steps", str(RING_STEPS), "--allreduce", "ring", "--profile-steps", "3:4"]),
    **{
        f"traffic-{name}": Run(strategy, [*TRAFFIC, *flags], nproc=n)
        for name, (strategy, flags, n) in TRAFFIC_RUNS.items()
    },
    **{
        f"traffic-{name}-accumulated": Run(strategy, [*TRAFFIC, *flags, *ACCUMULATE], nproc=n)
        for name, (strategy, flags, n) in TRAFFIC_RUNS.items()
        if name in ACCUMULATED
    },
}


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "communication"


@pytest.mark.parametrize("n", [3, 4])
def test_the_ring_equals_dist_all_reduce(runs, n):
    """Lengths that do and do not divide by n (1 .. 4099), integers exactly, floats to rounding (the ring adds
    the chunks in another order), over the whole world and over the even ranks (tests/integration/workers/): rings
    of 3 and 4 ranks, and of 2 (either world's even ranks)."""
    found = json.loads((runs / f"ring{n}" / "ring.json").read_text())
    assert found["world"] == n and any(length % n for length in found["lengths"])
    for group in ("whole", "evens"):
        assert all(r["equal"] for r in found[group]["torch.int64"]), group
        assert max(r["max_rel"] for r in found[group]["torch.float32"]) <= 1e-6, group


def test_ddp_through_the_ring_is_on_the_builtin_curve(runs):
    assert len(losses(runs / "ring")) == RING_STEPS
    # measured: 2.4e-7 and 3.3e-8 on an AVX2 EPYC, 1.2e-7 and 4.4e-7 on an AVX-512 Xeon (one step: the ring's other
    # order of adding, grown by AdamW); a chunk added twice or left out changes a quarter of the gradient by its size
    assert_follows(runs / "ring", runs / "builtin", loss=2e-6, grad_norm=2e-6)
    assert read_run(runs / "ring")["config"]["allreduce"] == "ring"


def test_the_ring_carries_the_gradients(runs):
    """In the profiled steps' backward, DDP's buckets travel as the ring's point-to-point sends (2 (n - 1) = 6 per
    bucket on 4 ranks) and no all-reduce runs there; with the built-in one, all-reduces and no sends."""
    per_rank = read_run(runs / "ring")["profile"]["per_rank"]
    assert len(per_rank) == 4  # (a rank that reported nothing would pass the loop)
    for rank in per_rank:
        backward = rank["collectives"]["backward"]
        assert "gloo:all_reduce" not in backward and backward["gloo:send"] == backward["gloo:recv"] > 0, backward
        assert backward["gloo:send"] % 6 == 0
    per_rank = read_run(runs / "builtin")["profile"]["per_rank"]
    assert len(per_rank) == 4
    for rank in per_rank:
        backward = rank["collectives"]["backward"]
        assert backward.get("gloo:all_reduce", 0) > 0 and "gloo:send" not in backward, backward


@pytest.mark.parametrize("name", TRAFFIC_RUNS)
def test_predicted_traffic_is_what_the_profiler_saw(runs, name, untrained):
    """Per rank and kind of collective, the elements the planner predicts from the model and the mesh equal the
    elements of the collectives in the profiled steps' trace (the loss's and the norm's single numbers aside)."""
    if f"traffic-{name}" in untrained:
        pytest.skip(untrained[f"traffic-{name}"])
    run = read_run(runs / f"traffic-{name}")
    strategy, flags, n = TRAFFIC_RUNS[name]
    cfg = parse_config(strategy, [*TRAFFIC, *flags], world_size=n)
    predicted = [traffic(cfg, n, rank) for rank in range(n)]  # planner/predict.py
    measured = [rank["traffic"] for rank in run["profile"]["per_rank"]]
    assert run["world_size"] == len(predicted) == len(measured) == n
    for rank, (mine, seen) in enumerate(zip(predicted, measured)):
        assert set(mine) == set(seen), rank
        for kind in mine:
            assert mine[kind]["elements"] == seen[kind]["elements"] > 0, (rank, kind)
    kinds = set().union(*predicted)
    expected = {
        "ddp": {"all_reduce"},
        "fsdp-full": {"all_gather", "reduce_scatter"},
        "fsdp-hybrid": {"all_gather", "reduce_scatter", "all_reduce"},
        "pp-1f1b": {"send", "recv"},
        "fsdp-x-tp": {"all_reduce", "all_gather", "reduce_scatter"},
        "vit-fsdp": {"all_gather", "reduce_scatter"},
        "vit-tp": {"all_reduce"},
        "vit-tp-sp": {"all_gather", "reduce_scatter", "all_reduce"},
        "vit-fsdp-x-tp-sp": {"all_gather", "reduce_scatter", "all_reduce"},
    }
    assert kinds == expected[name]


@pytest.mark.parametrize("name", ACCUMULATED)
def test_accumulation_reduces_once_per_step(runs, name, untrained):
    """With --grad-accum-steps 4 the gradients are reduced once per optimizer step, on the last chunk's backward
    (DDP's no_sync, FSDP's set_requires_gradient_sync): per rank, the reductions' calls and elements the profiler
    counted are those of the same step without accumulation, and their elements what the planner predicts for both;
    the all-gathers and TP's activation all-reduces run once per chunk: 4 times the calls (the all-gathers 4 times
    the elements, TP's all-reduces the same elements, each of a quarter of the samples)."""
    for run_name in (f"traffic-{name}", f"traffic-{name}-accumulated"):
        if run_name in untrained:
            pytest.skip(untrained[run_name])
    strategy, flags, n = TRAFFIC_RUNS[name]
    reductions, per_chunk = ACCUMULATED[name]
    plain, accumulated = (read_run(runs / f"traffic-{name}{suffix}") for suffix in ("", "-accumulated"))
    assert accumulated["config"]["grad_accum_steps"] == 4 and plain["config"]["grad_accum_steps"] == 1
    once, chunked = (parse_config(strategy, [*TRAFFIC, *flags, *more], world_size=n) for more in ([], ACCUMULATE))
    assert len(plain["profile"]["per_rank"]) == len(accumulated["profile"]["per_rank"]) == n
    for rank, (seen_once, seen) in enumerate(zip(plain["profile"]["per_rank"], accumulated["profile"]["per_rank"])):
        predicted_once, predicted = traffic(once, n, rank), traffic(chunked, n, rank)  # planner/predict.py
        counted_once, counted = seen_once["traffic"], seen["traffic"]
        assert set(predicted) == set(counted) == set(counted_once) == {*reductions, *per_chunk}, rank
        for kind in reductions:
            assert predicted[kind]["elements"] == predicted_once[kind]["elements"], (rank, kind)
            assert counted[kind]["elements"] == predicted[kind]["elements"] == counted_once[kind]["elements"], (
                rank,
                kind,
                counted[kind],
                counted_once[kind],
            )
            assert counted[kind]["calls"] == counted_once[kind]["calls"] > 0, (rank, kind, counted[kind])
        for kind in per_chunk:
            scale = 4 if kind == "all_gather" else 1  # (TP's activations: 4 chunks of a quarter of the samples)
            assert predicted[kind]["elements"] == scale * predicted_once[kind]["elements"], (rank, kind)
            assert counted[kind]["elements"] == predicted[kind]["elements"], (rank, kind)
            assert counted[kind]["calls"] == 4 * counted_once[kind]["calls"] > 0, (rank, kind)


def test_the_counted_traffic_timed_by_the_collective_benchmark(runs):
    """A real profiled run (FSDP, 4 ranks) and a made-up benchmark of exactly 1 GB/s for every op: the time the
    planner gives each rank's all-gathers (planner/timing.py's predict_time_s, the predicted bytes split over the
    calls the profiler counted) is their bytes per step / 1 GB/s; the profile timed every rank's collective spans."""
    from planner.timing import predict_time_s

    results = [{"op": op, "bytes": size, "time_s": size / 1e9} for op in OPS for size in (2**10, 2**30)]
    run = read_run(runs / "traffic-fsdp-full")
    cfg = parse_config("fsdp", [*TRAFFIC, *TRAFFIC_RUNS["fsdp-full"][1]], world_size=4)
    assert len(run["profile"]["per_rank"]) == 4
    for counted in run["profile"]["per_rank"]:
        calls = counted["traffic"]["all_gather"]["calls"]
        size = traffic(cfg, 4, counted["rank"])["all_gather"]["bytes"]
        assert calls > 0 and calls * predict_time_s(results, "all_gather", size / calls) == pytest.approx(size / 1e9)
        assert counted["comm_s"] > 0
