"""BabyGPT's mixture of experts through expert parallelism (train_ep.py) on real processes (gloo): EP on 2 and 4 ranks
and FSDP x EP (2 groups of 2 EP ranks) against train_ddp.py on one process step by step over 20 steps, with the
same tokens per expert as train_ep.py on one process; a capacity factor of 1 drops the same assignments on 2 ranks
as on one; a resumed EP run repeats the run bit for bit; EP's checkpoint on 4 ranks continued by EP on 2 (DCP
reshards the experts) and by DDP on one process on the same curve; the all-to-alls' elements, counted in the
profiler's trace, equal to what the recorded routing predicts; activation checkpointing lowers the peak, keeps
the curve, and runs the all-to-alls again in backward."""

import json
from pathlib import Path

import pytest

from common.profiling import _numel
from tests.helpers import (
    ONE_THREAD,
    Run,
    assert_follows,
    assert_resumed,
    grad_norms,
    losses,
    printed,
    read_metrics,
    read_run,
    tiered,
)

STEPS = 20
SEQ_LEN, BATCH, EXPERTS, TOP_K = 32, 32, 4, 2  # (--top-k's default with 4 experts: 2)
WIDTH, LAYERS = 64, 2  # baby's width and its blocks: an MoE layer each
# test_gpt.py's parity flags: fp32, no dropout, --lr 1e-4, a constant rate after the warm-up (a run cut at
# --max-steps 5 takes the first 5 steps of 20)
GPT = ["--model", "gpt", "--seq-len", str(SEQ_LEN), "--log-every", "1000", "--dropout", "0", "--warmup-steps", "4"]
GPT += ["--lr-schedule", "constant", "--train-size", "512", "--test-size", "64", "--experts", str(EXPERTS)]
PARITY = [*GPT, "--lr", "1e-4", "--batch-size", str(BATCH), "--max-steps", str(STEPS)]
CROSS = [*PARITY, "--checkpoint-every", "10"]  # a checkpoint after step 10 to resume and to cross
PROFILED = ["--profile-steps", "3:3"]  # the all-to-alls of step 3 in the trace (run.json's profile)
PEAK = ["--measure-peak"]  # the tensor bytes a rank holds over its second step (run.json's memory)
CHECKPOINTED = ["--activation-checkpointing"]
FIVE = ["--max-steps", "5"]
CAPACITY = ["--capacity-factor", "1"]  # each sequence sends an expert at most ceil(32 x 2 / 4) = 16 assignments
# |Δloss| and relative |Δgrad_norm| against one process: ~7x and ~20x the 1.4e-6 (3 ulps of the loss at ~4.9) and
# 4.6e-9 measured at most (EP on 2 and 4, FSDP x EP, checkpointed, the crossings, capacity 1 on 2 against 1; train_ep.py
# on one process equals train_ddp.py to the bit; 2-core AMD EPYC, torch 2.14.1, 2026-12-04, PARITY_REPORT)
FOLLOWS = {"loss": 1e-5, "grad_norm": 1e-7}

POOLED = {
    "ref": Run("ddp", [*CROSS, *ONE_THREAD], nproc=1),
    "ep1": Run("ep", [*PARITY, *ONE_THREAD], nproc=1),  # every expert on one process: the routing to match
    "ep2": Run("ep", [*CROSS, *PROFILED, *PEAK], nproc=2),  # (its step-10 checkpoint resumed bit for bit)
    "ep4": Run("ep", [*CROSS, *PROFILED]),  # (its step-10 checkpoint crosses to EP on 2 and DDP on 1)
    "fsdp-x-ep": Run("ep", [*PARITY, *PROFILED, "--ep", "2"], heavy=True),  # 2 groups x 2 EP ranks
    # the first 5 steps with each block recomputed in backward (its all-to-alls with it), and their peak
    "ep2-ac": Run("ep", [*PARITY, *PROFILED, *PEAK, *CHECKPOINTED, *FIVE], nproc=2),
    "ep1-cf1": Run("ep", [*PARITY, *ONE_THREAD, *CAPACITY, *FIVE], nproc=1),
    "ep2-cf1": Run("ep", [*PARITY, *CAPACITY, *FIVE], nproc=2),
    # resumed at step 10 in a fresh wrap, from a copy of the run as it stood then
    "ep2-resumed": Run("ep", [*CROSS, *PROFILED, *PEAK, "--resume"], nproc=2, rewound_from=("ep/ep2", 10)),
    # EP's 4-rank checkpoint of step 10 continued by EP on 2 ranks (2 experts a rank, not 1) and by DDP on one
    "ep2-from-ep4": Run("ep", [*CROSS, "--resume"], nproc=2, rewound_from=("ep/ep4", 10)),
    "ddp-from-ep4": Run("ddp", [*CROSS, *ONE_THREAD, "--resume"], nproc=1, rewound_from=("ep/ep4", 10)),
}
MESH = {"ep2": (1, 2), "ep4": (1, 4), "fsdp-x-ep": (2, 2), "ep2-ac": (1, 2)}  # (dp, ep)


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "ep"


def routing(out: Path, key: str = "tokens_per_expert") -> list:
    """A run's routing record of each step (metrics.jsonl), in step order."""
    train, _ = read_metrics(out)
    return [train[step][key] for step in sorted(train)]


# ------------------------------------------------------------------------------------ training against one process
@pytest.mark.parametrize("name", tiered(["ep2", "ep4", "fsdp-x-ep"], POOLED))
def test_ep_follows_one_process(runs, name):
    """Each rank runs E / ep experts of every layer (run.json and the printed line say so), its tokens sent to
    them by all-to-all, and holds 1 / world of every parameter, the experts' too (FSDP shards each EP rank's slice
    over the groups); the run follows train_ddp.py on one process step by step, and every step routes as many
    tokens to each expert as train_ep.py on one process (its routing is the one process's, not near it)."""
    dp, ep = MESH[name]
    assert len(losses(runs / name)) == STEPS
    assert_follows(runs / name, runs / "ref", **FOLLOWS)
    run = read_run(runs / name)
    assert run["strategy"] == "ep" and run["world_size"] == dp * ep and run["mesh"] == {"dp": dp, "ep": ep}
    assert run["ep"] == {"experts_per_rank": EXPERTS // ep}
    said = f"each rank runs {EXPERTS // ep} experts per block, their weights sharded over {dp} group(s) by FSDP"
    assert f"{said}; each token runs through {TOP_K}" in printed(runs / name)
    whole = read_run(runs / "ref")["memory"]["per_rank"][0]["param_bytes"]
    assert [r["param_bytes"] for r in run["memory"]["per_rank"]] == [whole // (dp * ep)] * (dp * ep)
    tokens = routing(runs / name)
    assert tokens == routing(runs / "ep1")
    assert all(sum(layer) == BATCH * SEQ_LEN * TOP_K for step in tokens for layer in step)  # every assignment, once
    assert len({tuple(layer) for step in tokens for layer in step}) > 1  # (the routing moves: no constant passes)
    assert routing(runs / name, "dropped") == [[0] * LAYERS] * STEPS  # dropless


def test_one_process_of_train_ep_follows_train_ddp(runs):
    assert_follows(runs / "ep1", runs / "ref", **FOLLOWS)


def test_a_capacity_factor_drops_the_same_assignments_on_2_ranks_as_on_one(runs):
    """--capacity-factor 1: each sequence sends an expert at most 16 of its 64 assignments; the rest are dropped
    (metrics.jsonl's "dropped", per layer), as many on 2 ranks as on one, with the same tokens per expert and loss."""
    dropped = routing(runs / "ep2-cf1", "dropped")
    assert len(dropped) == 5 and dropped == routing(runs / "ep1-cf1", "dropped")
    assert all(n > 0 for step in dropped for n in step), dropped  # (an untrained router is unbalanced)
    assert routing(runs / "ep2-cf1") == routing(runs / "ep1-cf1")
    assert_follows(runs / "ep2-cf1", runs / "ep1-cf1", **FOLLOWS)


# ------------------------------------------------------------------------------------ resume and crossings
def test_a_resumed_ep_run_repeats_the_run_bit_for_bit(runs):
    again = runs / "ep2-resumed"
    assert_resumed(again, 10, printed(again), source=runs / "ep2")
    assert len(losses(again)) == STEPS and losses(again) == losses(runs / "ep2")
    assert grad_norms(again) == grad_norms(runs / "ep2") and routing(again) == routing(runs / "ep2")
    assert read_metrics(again)[1] == read_metrics(runs / "ep2")[1]  # the evaluation after step 20 too


@pytest.mark.parametrize(
    "name, strategy, mesh", [("ep2-from-ep4", "ep", {"dp": 1, "ep": 2}), ("ddp-from-ep4", "ddp", None)]
)
def test_ep_checkpoints_continue_under_another_ep_degree_and_under_ddp(runs, name, strategy, mesh):
    """EP's checkpoint of step 10 on 4 ranks (the experts' DTensors split 4 ways) continued by EP on 2 ranks and by
    DDP on one process: each resumes (its line, the records before kept) and goes on along the one-process curve."""
    assert_resumed(runs / name, 10, printed(runs / name), source=runs / "ep4")
    run = read_run(runs / name)
    assert run["strategy"] == strategy and (mesh is None or run["mesh"] == mesh)
    assert len(losses(runs / name)) == STEPS
    assert_follows(runs / name, runs / "ref", **FOLLOWS, steps=range(11, STEPS + 1))


# ------------------------------------------------------------------------------------ the all-to-alls' traffic
def all_to_alls(trace: str) -> list[int]:
    """The elements each all_to_all_single of a rank's trace sent (its input, the call's second argument)."""
    events = json.loads(Path(trace).read_text())["traceEvents"]
    calls = [e for e in events if e.get("ph") == "X" and e.get("name") == "c10d::alltoall_base_"]
    return [_numel(e["args"]["Input Dims"][1]) for e in calls]


@pytest.mark.parametrize("name", tiered(["ep2", "ep4", "fsdp-x-ep", "ep2-ac"], POOLED))
def test_the_all_to_alls_send_what_the_routing_predicts(runs, name):
    """The profiled step's all-to-alls on every rank, from the trace: per MoE layer, the counts ([E] each way), the
    dispatch (this rank's kept assignments x the width) and the combine (the rows its experts received), then in
    backward the two reversed; with activation checkpointing the forward's three again in backward. Predicted from
    metrics.jsonl's routing of that step: summed over the ranks, each layer's kept assignments go out 4 times
    (dispatch, combine, and their reverses); with one EP group, rank r receives exactly the assignments routed to its
    experts, E r / ep onwards."""
    dp, ep = MESH[name]
    recomputed = name.endswith("-ac")
    forward, backward = 3 * LAYERS, (2 + 3 * recomputed) * LAYERS
    step = read_metrics(runs / name)[0][3]
    kept = [sum(layer) - dropped for layer, dropped in zip(step["tokens_per_expert"], step["dropped"])]
    profiled = read_run(runs / name)["profile"]["per_rank"]
    assert [rank["rank"] for rank in profiled] == list(range(dp * ep))  # every rank reported
    sent = [all_to_alls(rank["trace"]) for rank in profiled]
    rows_out = 4 + 2 * recomputed  # a row's sends: dispatch and combine, their reverses, recomputed: the forward's
    counts_out = 1 + recomputed
    total = sum(rows_out * WIDTH * k + dp * ep * counts_out * EXPERTS for k in kept)
    assert sum(map(sum, sent)) == total, (sent, kept)
    for rank, calls in zip(profiled, sent):
        spans = rank["collectives"]
        assert len(calls) == forward + backward
        assert (spans["forward"]["gloo:all_to_all"], spans["backward"]["gloo:all_to_all"]) == (forward, backward)
        assert calls.count(EXPERTS) == LAYERS * counts_out  # the counts, [E] each
        if dp == 1 and not recomputed:  # rank r's own assignments out, its experts' back: per layer, in call order
            mine = BATCH // ep * SEQ_LEN * TOP_K  # (dropless: all of them)
            r, local = rank["rank"], EXPERTS // ep
            received = [sum(layer[r * local : (r + 1) * local]) for layer in step["tokens_per_expert"]]
            expected = [n for got in received for n in (EXPERTS, mine * WIDTH, got * WIDTH)]  # forward, layer by layer
            expected += [n for got in reversed(received) for n in (mine * WIDTH, got * WIDTH)]  # backward, last first
            assert calls == expected, (r, calls, expected)


# ------------------------------------------------------------------------------------ activation checkpointing
def test_activation_checkpointing_lowers_the_peak_and_keeps_the_curve(runs):
    """With each block recomputed in backward, every rank's peak (its second step's tensor bytes) is lower than
    without, and the first 5 steps follow the one-process curve all the same."""
    assert read_run(runs / "ep2-ac")["config"]["activation_checkpointing"] is True
    with_ac, without = ([r["peak_bytes"] for r in read_run(runs / n)["memory"]["per_rank"]] for n in ("ep2-ac", "ep2"))
    assert len(with_ac) == len(without) == 2
    assert all(a < b for a, b in zip(with_ac, without)), (with_ac, without)
    assert len(losses(runs / "ep2-ac")) == 5
    assert_follows(runs / "ep2-ac", runs / "ref", **FOLLOWS, steps=range(1, 6))
    assert routing(runs / "ep2-ac") == routing(runs / "ep1")[:5]  # (read before backward recomputes the blocks)
