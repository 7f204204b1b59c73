"""BabyGPT (--model gpt) through the pipeline on real processes (gloo): cut between blocks (the embedding with the
first, the head with the last), its int64 tokens into the first stage, its loss over the scored positions on the
last; every schedule follows one process step by step on 2 and 4 processes and runs the order of actions it
prescribes; evaluation through the pipeline, its last batch padded; FSDP x PP x TP on 8 processes (2 x 2 x 2);
a resume bit for bit; checkpoints from DDP into the pipeline and from the 3-D mesh back into DDP."""

import json
import sys

import pytest

from common.versions import NEEDS_TP
from tests.helpers import (
    ONE_THREAD,
    Run,
    assert_follows,
    assert_resumed,
    grad_norms,
    losses,
    needs_torch,
    printed,
    read_metrics,
    read_run,
    run_command,
    tiered,
)
from tests.integration.test_pippy import TORCH_CLASS, prescribed_orders, recorded_orders

STEPS = 20
# 60 test sequences: no schedule step's batch divides them (16 on one pipeline, 8 per replica of two), so
# evaluation's last batch is padded and its padding must not count; 16 scored positions each (the copy's half)
TEST_SEQUENCES, SEQ_LEN = 60, 32
SCORED = TEST_SEQUENCES * SEQ_LEN // 2
# the built-in copy task, small and short, at the settings where runs agree step by step: dropout 0, fp32, --lr 1e-4;
# a constant rate after 4 warm-up steps, so that a 10-step run is a 20-step run's prefix
GPT = ["--model", "gpt", "--seq-len", str(SEQ_LEN), "--train-size", "512", "--test-size", str(TEST_SEQUENCES)]
GPT += ["--batch-size", "16", "--dropout", "0", "--warmup-steps", "4", "--lr-schedule", "constant"]
GPT += ["--log-every", "1000"]
PARITY = [*GPT, "--lr", "1e-4", "--max-steps", str(STEPS), "--eval-every", "10"]
CROSS = [*PARITY, "--checkpoint-every", "10"]  # (the runs whose step 10 another strategy continues, and those)
TEN = ["--max-steps", "10"]
# baby has 2 blocks, so at most 2 stages; the schedules of 2 stages per rank need 4: small's 6 blocks (4.5 M
# parameters), 10 steps, on 2 pipeline ranks (4 stages), and on 4 processes as 2 replicas of them (--dp 2)
SMALL = [*PARITY, "--model-size", "small", *TEN]
MULTI_STAGE = ("interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")  # 2 stages per rank
# --lr 2e-3: a 1-ulp difference would grow, so only an exact resume repeats the run
EXACT = [*GPT, "--lr", "2e-3", "--max-steps", "12", "--checkpoint-every", "6"]
MESH_3D = ["--dp", "2", "--tp", "2"]  # (pipeline ranks: 8 / (2 x 2) = 2)
# |Δloss| and relative |Δgrad_norm| against one process: ~10x the 9.5e-7 and 2.7e-8 measured (2-core AMD EPYC
# Zen 4, torch 2.14.1, 2026-12-03: every run here, the heavy tier's too)
FOLLOWS = {"loss": 1e-5, "grad_norm": 3e-7}

POOLED = {
    "ref": Run("ddp", [*CROSS, *ONE_THREAD], nproc=1),  # (its step-10 checkpoint: the pipeline continues it)
    "ref-small": Run("ddp", [*SMALL, *ONE_THREAD], nproc=1),
    # baby: 2 stages on 2 ranks, and 2 replicas of them on 4 (FSDP2 across the replicas)
    "pp2-1f1b": Run("pippy", PARITY, nproc=2),
    "pp2-gpipe": Run("pippy", [*PARITY, "--schedule", "gpipe", *TEN], nproc=2),
    "pp4-dp2-1f1b": Run("pippy", [*PARITY, "--dp", "2"]),
    # small: 4 stages on 4 ranks (the middle stages receive and send the residual stream both ways)
    "small-pp4-1f1b": Run("pippy", SMALL),
    "small-pp4-gpipe": Run("pippy", [*SMALL, "--schedule", "gpipe"], heavy=True),
    # small: the multi-stage schedules, 2 stages per rank; ZBV's V on 2 ranks every pytest, the others and all on
    # 4 processes (2 replicas) in the heavy tier
    **{
        f"small-pp{n}-{s}": Run(
            "pippy",
            [*SMALL, "--schedule", s, "--stages-per-rank", "2", *(["--dp", "2"] if n == 4 else [])],
            nproc=n,
            heavy=(n, s) != (2, "zbv"),
        )
        for n in (2, 4)
        for s in MULTI_STAGE
    },
    # FSDP x PP x TP on 8 processes (2 x 2 x 2), with a checkpoint at step 10 that DDP continues; 2 micro-batches
    # (as many as its stages), the fewest TP collectives per step
    # (heavy: 8 processes on a laptop's cores cost the most of any run here; the ViT's 3-D mesh is every pytest's)
    "3d": Run("pippy", [*CROSS, *MESH_3D, "--n-microbatches", "2"], nproc=8, heavy=True),
    # resumed at step 6 of 12 in a fresh pipeline, from a copy of the run as it stood then
    "exact": Run("pippy", EXACT, nproc=2),
    "exact-resumed": Run("pippy", [*EXACT, "--resume"], nproc=2, rewound_from=("gpt_pipeline/exact", 6)),
    # one process's checkpoint continued by a pipeline, the 3-D mesh's (TP's halves, FSDP's shards) by DDP on 2
    "pp2-from-ddp": Run("pippy", [*CROSS, "--resume"], nproc=2, rewound_from=("gpt_pipeline/ref", 10)),
    "ddp-from-3d": Run("ddp", [*CROSS, "--resume"], nproc=2, rewound_from=("gpt_pipeline/3d", 10), heavy=True),
}
PARITY_RUNS = [name for name in POOLED if name.startswith(("pp", "small-pp", "3d")) and "from" not in name]


def reference(name: str) -> str:
    return "ref-small" if name.startswith("small") else "ref"


def flag(name: str, key: str, default: str) -> str:
    """The value of flag `key` in run `name`'s flags (the last one given: SMALL's --max-steps 10 over PARITY's 20)."""
    flags = POOLED[name].flags
    return dict(zip(flags[::2], flags[1::2])).get(key, default)


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "gpt_pipeline"


@pytest.mark.parametrize("name", tiered(PARITY_RUNS, POOLED))
def test_the_pipeline_follows_one_process(runs, name):
    """Every schedule, each number of processes: the loss and the gradient norm of one process at every step, and the
    evaluation through the pipeline (every test sequence's scored positions counted once) the same predictions."""
    ref = runs / reference(name)
    steps = len(losses(runs / name))
    assert steps == int(flag(name, "--max-steps", "0"))
    assert_follows(runs / name, ref, **FOLLOWS)
    run = read_run(runs / name)
    assert run["config"]["model"] == "gpt" and run["model"]["size"] == flag(name, "--model-size", "baby")
    assert run["model"]["parameters"] == read_run(ref)["model"]["parameters"]
    (evaluation,) = [e for e in read_metrics(runs / name)[1] if e["step"] == steps]
    (expected,) = [e for e in read_metrics(ref)[1] if e["step"] == steps]
    hits = evaluation["test_accuracy"] * SCORED
    assert hits == pytest.approx(round(hits)) and round(hits) == round(expected["test_accuracy"] * SCORED)
    assert evaluation["test_loss"] == pytest.approx(expected["test_loss"], abs=FOLLOWS["loss"])


@pytest.mark.parametrize("name", tiered([n for n in PARITY_RUNS if n != "3d"], POOLED))
def test_the_schedule_that_ran_is_the_one_named(runs, name):
    """Each rank's actions of the last step, as recorded, are those the named schedule prescribes (GPipe and 1F1B
    written out, the others as torch's own class orders them): no schedule passes as another."""
    schedule, v = flag(name, "--schedule", "1f1b"), int(flag(name, "--stages-per-rank", "1"))
    run = read_run(runs / name)
    pipeline = run["pipeline"]
    assert pipeline["n_stages"] == pipeline["pp_size"] * v
    p, m = pipeline["pp_size"], run["config"]["n_microbatches"]
    assert recorded_orders(runs / name) == prescribed_orders(schedule, p=p, v=v, m=m), name
    assert pipeline["schedule_class"] == TORCH_CLASS[schedule] and run["config"]["schedule"] == schedule
    assert pipeline["bubble"]["same_order_every_step"] and pipeline["bubble"]["orders_step"] == len(losses(runs / name))


def stage_params(model, stage_layers: list[list[str]]) -> list[int]:
    """The parameters of each stage, counted on the whole model by the layers the run says each stage holds."""
    return [
        sum(p.numel() for layer in layers for p in model.get_submodule(layer).parameters()) for layers in stage_layers
    ]


@pytest.mark.parametrize("name, stages", [("pp2-1f1b", 2), ("small-pp4-1f1b", 4), ("small-pp2-zbv", 4)])
def test_the_cut_is_between_blocks_and_each_rank_holds_its_stages(runs, name, stages):
    """The embedding rides with the first block, the final norm and output layer with the last, every other stage
    starts at a block; each pipeline rank holds its stages' parameters and no others (ZBV's V: rank 0 the first and
    the last stage)."""
    from common.model import build_model

    layers = json.loads((runs / name / "timeline.json").read_text())["stage_layers"]
    size = flag(name, "--model-size", "baby")
    depth = {"baby": 2, "small": 6}[size]
    assert (
        len(layers) == stages
        and layers[0][:2] == ["embed", "block0"]
        and layers[-1][-2:] == [f"block{depth - 1}", "head"]
    )
    assert all(stage[0].startswith("block") for stage in layers[1:])
    assert [layer for stage in layers for layer in stage] == ["embed", *(f"block{i}" for i in range(depth)), "head"]
    model = build_model(model="gpt", size=size, seed=0, vocab_size=128, seq_len=SEQ_LEN)
    params = stage_params(model, layers)
    run = read_run(runs / name)
    held = run["pipeline"]["stages_of_each_pipeline_rank"]
    per_rank = run["memory"]["per_rank"]
    assert [rank["rank"] for rank in per_rank] == list(range(len(held)))  # every rank reported
    for rank in per_rank:
        assert rank["param_bytes"] == 4 * sum(params[s] for s in held[rank["rank"]]), rank


def test_a_resumed_pipeline_repeats_the_run_bit_for_bit(runs):
    again = runs / "exact-resumed"
    assert_resumed(again, 6, printed(again), source=runs / "exact")
    full = losses(runs / "exact")
    assert losses(again) == full and grad_norms(again) == grad_norms(runs / "exact")
    assert max(full) - min(full) > 0.05  # at --lr 2e-3 the curve moves: a 1-ulp difference would have grown


@pytest.mark.heavy
@needs_torch(NEEDS_TP)
def test_fsdp_x_pp_x_tp_on_8_processes_follows_one_process_and_crosses_to_ddp(runs):
    """The 3-D mesh: each rank holds its stage's layers (PP), of the split ones (the vocabulary-split embedding and
    output layer, q, k, v, o and SwiGLU's three) its TP half, of all that its FSDP half -- to the byte; the run
    follows one process over 20 steps, and its checkpoint of step 10 continues under DDP on the same curve."""
    from common.model import build_model

    assert_follows(runs / "3d", runs / "ref", **FOLLOWS)
    run = read_run(runs / "3d")
    assert run["mesh"] == {"dp": 2, "pp": 2, "tp": 2} and run["world_size"] == 8
    assert "8 processes = 2 replica(s) x 2 pipeline ranks x 2 TP ranks, 2 stages" in printed(runs / "3d")
    model = build_model(model="gpt", seed=0, vocab_size=128, seq_len=SEQ_LEN)
    plan = model.tp_plan(loss_parallel=False)
    stages = json.loads((runs / "3d" / "timeline.json").read_text())["stage_layers"]
    held = [0.0, 0.0]
    for name, p in model.named_parameters():
        layer = name.rsplit(".", 1)[0]
        stage = next(i for i, layers in enumerate(stages) if name.split(".")[0] in layers)
        held[stage] += 4 * p.numel() / (2 if layer in plan else 1) / 2  # fp32, TP's half of a split one, FSDP's half
    assert len(plan) == 2 + 2 * 7  # the embedding, the output layer, 7 in each block (no sequence parallel)
    assert [rank["rank"] for rank in run["memory"]["per_rank"]] == list(range(8))  # every rank reported
    for rank in run["memory"]["per_rank"]:  # rank = (replica x 2 + pipeline rank) x 2 + TP rank
        assert rank["param_bytes"] == held[rank["rank"] // 2 % 2], rank
    assert_resumed(runs / "ddp-from-3d", 10, printed(runs / "ddp-from-3d"), source=runs / "3d")
    assert read_run(runs / "ddp-from-3d")["strategy"] == "ddp"
    assert_follows(runs / "ddp-from-3d", runs / "ref", steps=range(11, STEPS + 1), **FOLLOWS)


def test_one_process_checkpoint_continues_in_the_pipeline(runs):
    """DDP's step-10 checkpoint (the whole model) loaded into 2 stages, each rank its layers, on the same curve."""
    assert_resumed(runs / "pp2-from-ddp", 10, printed(runs / "pp2-from-ddp"), source=runs / "ref")
    assert read_run(runs / "pp2-from-ddp")["strategy"] == "pippy"
    assert_follows(runs / "pp2-from-ddp", runs / "ref", steps=range(11, STEPS + 1), **FOLLOWS)


BAD = [  # (world size, flags, the flag the one line names, a word of the explanation)
    (4, ["--model", "gpt"], "--stages-per-rank", "gpt baby can be cut into at most 2"),
    (2, ["--model", "gpt", "--model-size", "gpt2-124m"], "--model-size gpt2-124m", "tied"),
    (8, ["--model", "gpt", "--dp", "2", "--tp", "4", "--heads", "2"], "--heads", "do not split"),
]


@pytest.mark.parametrize("world,flags,named,why", [pytest.param(*b, id=f"{b[2]}-{i}") for i, b in enumerate(BAD)])
def test_preflight_rejects_what_the_pipeline_cannot_cut_or_split(world, flags, named, why):
    proc = run_command(
        [sys.executable, "-m", "runner.preflight", "pippy", "--world-size", str(world), *flags], check=False, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {named}:") and why in lines[0], lines[0]
