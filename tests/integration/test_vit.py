"""BabyViT (--model vit) through every strategy on real processes (gloo): DDP, FSDP (a unit per block, each block
checkpointed), the pipeline (cut between blocks: every schedule, replicas) and TP (Megatron's split of every block,
with and without sequence parallel, FSDP x TP) follow one process step by step on 2 and 4 ranks, clipped; each
resumes its own checkpoint bit for bit; one checkpoint crosses DDP -> TP -> FSDP -> the pipeline, and TP's back to
DDP; checkpointing recomputes each block, in bf16 under mixed precision. The planner's ViT against real runs:
tests/integration/test_plan.py; TP's traffic with sequence parallel: test_communication.py."""

import json
import struct
import sys

import pytest

from common.versions import NEEDS_TP
from tests.helpers import (
    SMALL,
    TEST_SIZE,
    Run,
    assert_follows,
    assert_resumed,
    grad_norms,
    losses,
    markdown_rows,
    needs_torch,
    observed,
    printed,
    read_metrics,
    read_run,
    run_command,
    tiered,
)

STEPS = 20
# (a constant rate: a run cut at --max-steps 10 takes the same steps as the first 10 of 20)
VIT = ["--model", "vit", *SMALL, "--dropout", "0", "--warmup-steps", "4", "--lr-schedule", "constant"]
VIT += ["--max-steps", str(STEPS)]
# clipped: the whole gradient's norm is above 1 on most steps (the reference's are checked)
PARITY = [*VIT, "--lr", "1e-4", "--batch-size", "48", "--eval-every", "10", "--max-grad-norm", "1"]
# --lr 2e-3: a 1-ulp difference would grow, so only an exact resume repeats the run
EXACT = [*VIT, "--lr", "2e-3", "--batch-size", "48", "--checkpoint-every", "6", "--max-steps", "12"]
CROSS = [*PARITY, "--checkpoint-every", "6"]
BLOCKS = ["--shard-units", "blocks"]
MESH_3D = ["--dp", "2", "--tp", "2"]  # (pipeline ranks: 8 / (2 x 2) = 2)
EXACT_RUNS = {"ddp": [], "fsdp": [], "pippy": [], "tp": ["--sequence-parallel"]}  # (strategy: its flags)
SCHEDULES_ON_2 = ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")  # 2 stages per rank
# |Δloss| and relative |Δgrad_norm| against one process: ~10x the 4.8e-7 and 6.5e-8 measured here
FOLLOWS = {"loss": 5e-6, "grad_norm": 1e-6}
SP_OR_NOT = (("", []), ("-sp", ["--sequence-parallel"]))
# The parity runs train the reference's first 10 steps (the constant rate makes them its prefix, and a strategy that
# splits, gathers or reduces wrongly is off from the first step), evaluating at their last; TP on 4 ranks and FSDP x
# TP its first 5 (4 processes on 2 cores cost TP three times what 2 do). The reference trains all 20 steps, for the
# checkpoint that crosses the strategies, and evaluates every 5.
TEN = ["--max-steps", "10"]
FIVE = ["--max-steps", "5"]
SHORT_RUNS = ("tp4", "fsdp-x-tp")  # the runs of FIVE steps

POOLED = {
    "ref": Run("ddp", [*CROSS, "--eval-every", "5"], nproc=1),
    "ddp2": Run("ddp", [*CROSS, *TEN], nproc=2),  # (its step-6 checkpoint starts the crossing below)
    "ddp4": Run("ddp", [*PARITY, *TEN]),
    **{f"fsdp{n}": Run("fsdp", [*PARITY, *BLOCKS, *TEN], nproc=n) for n in (2, 4)},
    "fsdp2-ac": Run("fsdp", [*PARITY, *BLOCKS, "--activation-checkpointing", *TEN], nproc=2, observe=True),
    "fsdp2-bf16-ac": Run(
        "fsdp", [*PARITY, *BLOCKS, "--activation-checkpointing", "--precision", "bf16", *TEN], nproc=2, observe=True
    ),
    "pp4-1f1b": Run("pippy", [*PARITY, *TEN]),
    "pp4-gpipe": Run("pippy", [*PARITY, "--schedule", "gpipe", *TEN]),
    "pp4-dp2": Run("pippy", [*PARITY, "--dp", "2", *TEN]),
    "pp2-1f1b": Run("pippy", [*PARITY, *TEN], nproc=2),
    # (every schedule's matrix is BabyCNN's, test_pippy.py; of the ViT's 4 stages on 2 ranks, ZBV's V runs on every
    # pytest, the other multi-stage schedules in the heavy tier)
    **{
        f"pp2-{s}": Run("pippy", [*PARITY, "--schedule", s, "--stages-per-rank", "2", *TEN], nproc=2, heavy=s != "zbv")
        for s in SCHEDULES_ON_2
    },
    # TP on 4 ranks and FSDP x TP (2 x 2), 5 steps: the 10-step parity of TP is tp2's and tp2-sp's
    # (tp4 heavy: TP on 4 ranks is tp4-sp's and FSDP x TP's every pytest)
    **{f"tp{n}": Run("tp", [*PARITY, *(TEN if n == 2 else FIVE)], nproc=n, heavy=n == 4) for n in (2, 4)},
    **{f"tp{n}-sp": Run("tp", [*PARITY, "--sequence-parallel", *(TEN if n == 2 else FIVE)], nproc=n) for n in (2, 4)},
    **{f"fsdp-x-tp{sp}": Run("tp", [*PARITY, "--dp", "2", *flags, *FIVE]) for sp, flags in SP_OR_NOT},
    # resumed at step 6 of 12 in a fresh set of wraps, from a copy of the run as it stood then (2 processes: the
    # arithmetic repeats at any world size, and 4 processes on 2 cores cost TP three times as much)
    **{f"exact-{s}": Run(s, [*EXACT, *flags], nproc=2) for s, flags in EXACT_RUNS.items()},
    **{
        f"exact-{s}-resumed": Run(s, [*EXACT, *flags, "--resume"], nproc=2, rewound_from=(f"vit/exact-{s}", 6))
        for s, flags in EXACT_RUNS.items()
    },
    # one checkpoint through four strategies on 2 processes: DDP's step 6 resumed by TP (sequence parallel), whose
    # step 12 FSDP resumes, whose step 18 the pipeline resumes; and TP's step 12 back to DDP
    **{
        f"cross-{s}": Run(s, [*CROSS, *flags, "--resume"], nproc=2, rewound_from=(f"vit/{source}", step))
        for s, flags, source, step in (
            ("tp", ["--sequence-parallel", "--max-steps", "12"], "ddp2", 6),
            ("fsdp", BLOCKS, "cross-tp", 12),
            ("pippy", [], "cross-fsdp", 18),
            ("ddp", [], "cross-tp", 12),
        )
    },
    # FSDP x PP x TP on 8 processes (2 x 2 x 2): its first 4 steps, and from one process's checkpoint; DDP resumes it
    "3d": Run("pippy", [*CROSS, *MESH_3D, "--max-steps", "4", "--checkpoint-every", "4"], nproc=8),
    "3d-from-1d": Run("pippy", [*CROSS, *MESH_3D, "--resume"], nproc=8, rewound_from=("vit/ref", 18)),
    "1d-from-3d": Run("ddp", [*CROSS, "--resume"], nproc=2, rewound_from=("vit/3d", 4)),
}
PARITY_RUNS = [name for name in POOLED if name.startswith(("ddp", "fsdp", "pp", "tp")) and "bf16" not in name]


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "vit"


@pytest.mark.parametrize("name", tiered(PARITY_RUNS, POOLED))
def test_every_strategy_follows_one_process(runs, name):
    steps = len(losses(runs / name))
    assert steps == (5 if name.startswith(SHORT_RUNS) else 10)
    assert_follows(runs / name, runs / "ref", **FOLLOWS)
    assert sum(norm > 1 for norm in grad_norms(runs / "ref")) >= STEPS // 2  # clipped on most steps
    run = read_run(runs / name)
    assert run["model"] == {"size": "baby", "parameters": 304_906} and run["config"]["model"] == "vit"
    assert run["config"].get("sequence_parallel", False) == name.endswith("-sp")
    # the evaluation at its last step, through the strategy's own forward: the same predictions
    (evaluation,) = [e for e in read_metrics(runs / name)[1] if e["step"] == steps]
    (reference,) = [e for e in read_metrics(runs / "ref")[1] if e["step"] == steps]
    assert round(evaluation["test_accuracy"] * TEST_SIZE) == round(reference["test_accuracy"] * TEST_SIZE)


def test_the_pipeline_cuts_between_blocks(runs):
    """The embedding rides with the first block, the head with the last, and every stage starts at a block."""
    stages = read_run(runs / "pp4-1f1b")["pipeline"]
    assert stages["n_stages"] == 4
    layers = json.loads((runs / "pp4-1f1b" / "timeline.json").read_text())["stage_layers"]
    assert layers[0][0] == "embed" and layers[-1][-1] == "head"
    assert all(stage[0].startswith("block") for stage in layers[1:]) and sum(len(s) for s in layers) == 8


def test_the_comparison_draws_the_vit_curves(runs, tmp_path, untrained):
    """tools.compare (what run_all.sh ends with) over the ViT runs of the four strategies: one figure, one table."""
    names = [n for n in ("ref", "ddp4", "fsdp4", "pp4-1f1b", "tp2") if n not in untrained]
    figure = tmp_path / "vit.png"
    command = [sys.executable, "-m", "tools.compare", *(str(runs / n) for n in names), "--out", str(figure)]
    rows = markdown_rows(run_command([*command, "--markdown"]).stdout)
    png = figure.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", png[16:24])[0] > 1000
    assert [rows[n]["steps"] for n in names] == ["20", *["10"] * (len(names) - 1)]
    assert all(float(row["max |Δloss| vs ref"]) <= FOLLOWS["loss"] for row in rows.values()), rows


@pytest.mark.parametrize("strategy", EXACT_RUNS)
def test_a_resumed_run_repeats_the_run_bit_for_bit(runs, strategy, untrained):
    if f"exact-{strategy}" in untrained:
        pytest.skip(untrained[f"exact-{strategy}"])
    again = runs / f"exact-{strategy}-resumed"
    assert_resumed(again, 6, printed(again), source=runs / f"exact-{strategy}")
    full = losses(runs / f"exact-{strategy}")
    assert losses(again) == full and grad_norms(again) == grad_norms(runs / f"exact-{strategy}")
    assert max(full) - min(full) > 0.1  # at --lr 2e-3 the curve moves: a 1-ulp difference would have grown


@needs_torch(NEEDS_TP)
def test_one_checkpoint_crosses_ddp_tp_fsdp_and_the_pipeline(runs):
    """Each leg resumes the previous one's checkpoint (its line, its records kept) and stays on the reference's
    curve: TP's split layers load DDP's whole ones, FSDP loads TP's shards, DDP TP's too."""
    legs = [("cross-tp", "ddp2", 6, 12), ("cross-fsdp", "cross-tp", 12, 20), ("cross-pippy", "cross-fsdp", 18, 20)]
    for name, source, step, end in [*legs, ("cross-ddp", "cross-tp", 12, 20)]:  # (name, from, at step, to step)
        assert_resumed(runs / name, step, printed(runs / name), source=runs / source)
        assert read_run(runs / name)["strategy"] == name.split("-")[1]
        assert len(losses(runs / name)) == end
        assert_follows(runs / name, runs / "ref", steps=range(step + 1, end + 1), **FOLLOWS)


@pytest.mark.parametrize("name, tp", [("tp2", 2), ("tp4-sp", 4)])
def test_tp_gives_each_rank_its_share_of_every_block(runs, name, tp):
    """Every rank holds 1/tp of each block's q, k, v and fc1 (rows: its heads, its part of the MLP) and of proj's and
    fc2's weights (columns), in the parameters the run reports as split; the rest (norms, embedding, head) whole."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from common.model import build_model

    model = build_model(model="vit", seed=0)
    split = 0
    for layer, style in model.tp_plan().items():
        for kind, p in model.get_submodule(layer).named_parameters():
            split += 0 if kind == "bias" and isinstance(style, RowwiseParallel) else p.numel()  # (a row's bias: whole)
    run = read_run(runs / name)
    assert len(run["tp"]["split_layers"]) == 6 * 6  # q, k, v, proj, fc1, fc2 in each of the 6 blocks
    assert len(run["memory"]["per_rank"]) == tp  # every rank reported
    for rank in run["memory"]["per_rank"]:
        assert rank["param_bytes_of"]["split"] == 4 * split // tp, rank


@pytest.mark.parametrize("name", ["fsdp2-ac", "fsdp2-bf16-ac"])
def test_checkpointing_recomputes_each_block_in_the_compute_dtype(runs, name):
    """Each block is wrapped before fully_shard: its layers run again inside backward, all but the MLP's last (its
    output is not needed, and the recomputation stops once backward has what it needs); the embedding and the
    head, outside any block, do not. Under bf16 mixed precision the block recomputes in bf16."""
    dtype = "torch.bfloat16" if "bf16" in name else "torch.float32"
    probes = observed(runs / name)
    assert len(probes) == 2  # both ranks
    for rank in probes:
        # a block's Linear layers (q, k, v, proj, fc1; fc2 not) and LayerNorms (2): 6 blocks, 10 steps
        assert rank["calls"]["recomputed"] == 10 * 6 * 7, rank["calls"]
        assert rank["recomputed_dtypes"] == {"Linear": [dtype], "LayerNorm": [dtype]}, rank


@needs_torch(NEEDS_TP)
def test_fsdp_x_pp_x_tp_on_8_processes_follows_one_process_and_crosses_to_1d(runs):
    """The 3-D mesh: each rank holds its stage's blocks (PP), of their split layers its TP half, of all that its FSDP
    half -- to the byte -- and the run follows one process step by step; a checkpoint crosses 1-D -> 3-D -> 1-D."""
    from torch.distributed.tensor.parallel import RowwiseParallel

    from common.model import build_model

    assert_follows(runs / "3d", runs / "ref", **FOLLOWS)
    run = read_run(runs / "3d")
    assert run["mesh"] == {"dp": 2, "pp": 2, "tp": 2} and run["world_size"] == 8
    assert "8 processes = 2 replica(s) x 2 pipeline ranks x 2 TP ranks, 2 stages" in printed(runs / "3d")
    model = build_model(model="vit", seed=0)
    plan = model.tp_plan()
    stages = json.loads((runs / "3d" / "timeline.json").read_text())["stage_layers"]
    held = [0.0, 0.0]
    for name, p in model.named_parameters():
        layer, kind = name.rsplit(".", 1)
        split = layer in plan and not (kind == "bias" and isinstance(plan[layer], RowwiseParallel))
        stage = next(i for i, layers in enumerate(stages) if name.split(".")[0] in layers)
        held[stage] += 4 * p.numel() / (2 if split else 1) / 2  # fp32, TP's half of a split one, FSDP's half
    assert [rank["rank"] for rank in run["memory"]["per_rank"]] == list(range(8))  # every rank reported
    for rank in run["memory"]["per_rank"]:  # rank = (replica x 2 + pipeline rank) x 2 + TP rank
        assert rank["param_bytes"] == held[rank["rank"] // 2 % 2], rank
    assert_resumed(runs / "3d-from-1d", 18, printed(runs / "3d-from-1d"), source=runs / "ref")
    assert_resumed(runs / "1d-from-3d", 4, printed(runs / "1d-from-3d"), source=runs / "3d")
    for name, step in (("3d-from-1d", 18), ("1d-from-3d", 4)):
        assert_follows(runs / name, runs / "ref", steps=range(step + 1, STEPS + 1), **FOLLOWS)
