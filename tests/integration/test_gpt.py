"""BabyGPT (--model gpt) through DDP and FSDP on real processes (gloo): both follow one process step by step on 2 and 4
ranks (FSDP fully sharded, a unit per block: its collectives counted); activation checkpointing recomputes each block,
in bf16 under mixed precision; each resumes its own checkpoint bit for bit, and a checkpoint crosses DDP -> FSDP and
FSDP -> DDP; the loss and the evaluation score the copied half's positions alone; a text file (--data-file) trains on
2 ranks as on one."""

import hashlib
import os
import tempfile
from pathlib import Path

import pytest
import torch

from tests.helpers import (
    ONE_THREAD,
    Run,
    assert_follows,
    assert_resumed,
    grad_norms,
    losses,
    max_abs_diff,
    observed,
    printed,
    read_metrics,
    read_run,
    tiered,
)

STEPS = 20
SEQ_LEN = 32
TEST_SIZE = 64
SCORED = TEST_SIZE * SEQ_LEN // 2  # the copy task scores the copied half of each test sequence
# (a constant rate after the warm-up: a run cut at --max-steps 10 takes the same steps as the first 10 of 20)
GPT = ["--model", "gpt", "--seq-len", str(SEQ_LEN), "--log-every", "1000", "--dropout", "0", "--warmup-steps", "4"]
GPT += ["--lr-schedule", "constant"]
COPY = [*GPT, "--train-size", "512", "--test-size", str(TEST_SIZE)]
# fp32, no dropout, --lr 1e-4: where runs agree step by step (helpers.STABLE); a checkpoint after step 10 to cross
PARITY = [*COPY, "--lr", "1e-4", "--batch-size", "32", "--max-steps", str(STEPS)]
CROSS = [*PARITY, "--checkpoint-every", "10"]
BLOCKS = ["--sharding", "full", "--shard-units", "blocks"]
PROFILED = ["--profile-steps", "3:3"]  # the collectives of step 3 counted (run.json's profile)
CHECKPOINTED = ["--activation-checkpointing"]
BF16 = ["--precision", "bf16"]
TEN = ["--max-steps", "10"]
# |Δloss| and relative |Δgrad_norm| against one process: ~10x what was measured
# (9.5e-7 and 9.8e-9 at most in every comparison: DDP and FSDP on 2 and 4 ranks, the crossings, the text file; 2-core
# AMD EPYC Zen 4, torch 2.14.1, 2026-12-03)
FOLLOWS = {"loss": 1e-5, "grad_norm": 1e-7}
# FSDP's bf16 against the same run in fp32, over 10 steps: ~10x the 6.1e-5 and 2.4e-4 measured there
BF16_BAND = {"loss": 6e-4, "grad_norm": 3e-3}

# A few KB of English the test writes (--data-file reads bytes: a vocabulary of 256), the same file for every session
# (named by its contents, written whole by a rename): 113 training sequences of 32 bytes, 12 test ones
SENTENCES = (
    "The quick brown fox jumps over the lazy dog. Every rank reads the same file and takes its share of each batch. "
    "A small model learns which letter comes next. Two processes agree with one, step by step.\n"
)
TEXT = SENTENCES * 20  # 4,020 bytes
TEXT_FILE = Path(tempfile.gettempdir()) / f"babygpt-{hashlib.sha256(TEXT.encode()).hexdigest()[:12]}.txt"
TEXT_STEPS = 8
TEXT_RUN = [*GPT, "--data-file", str(TEXT_FILE), "--lr", "1e-4", "--batch-size", "16"]
TEXT_RUN += ["--max-steps", str(TEXT_STEPS)]


def write_text_file() -> None:
    if TEXT_FILE.exists() and TEXT_FILE.read_text() == TEXT:
        return
    fd, partial = tempfile.mkstemp(dir=TEXT_FILE.parent, prefix=".babygpt-")
    with os.fdopen(fd, "w") as f:
        f.write(TEXT)
    os.replace(partial, TEXT_FILE)  # whole or not at all: another session may read it meanwhile


write_text_file()  # (at collection: the shared launches start before any test runs)

POOLED = {
    "ref": Run("ddp", [*CROSS, *ONE_THREAD, "--eval-every", "10"], nproc=1),
    "ddp2": Run("ddp", [*CROSS, *PROFILED], nproc=2),  # (its step-10 checkpoint crosses to FSDP)
    "ddp4": Run("ddp", PARITY, heavy=True),  # (heavy: 4 ranks are FSDP's every pytest, DDP's the heavy tier's)
    "fsdp2": Run("fsdp", [*CROSS, *BLOCKS, *PROFILED], nproc=2, observe=True),  # (its step-10 one to DDP)
    "fsdp4": Run("fsdp", [*PARITY, *BLOCKS]),
    # checkpointing, in fp32 and in bf16: the reference's first 10 steps
    "fsdp2-ac": Run("fsdp", [*PARITY, *BLOCKS, *CHECKPOINTED, *TEN], nproc=2, observe=True),
    "fsdp2-bf16-ac": Run("fsdp", [*PARITY, *BLOCKS, *CHECKPOINTED, *BF16, *TEN], nproc=2, observe=True),
    # each resumed at step 10 in a fresh wrap, from a copy of the run as it stood then
    "ddp2-resumed": Run("ddp", [*CROSS, *PROFILED, "--resume"], nproc=2, rewound_from=("gpt/ddp2", 10)),
    "fsdp2-resumed": Run("fsdp", [*CROSS, *BLOCKS, *PROFILED, "--resume"], nproc=2, rewound_from=("gpt/fsdp2", 10)),
    # DDP's 2-rank checkpoint of step 10 resumed by FSDP on 4 ranks (DCP reshards it), FSDP's by DDP on 2
    "cross-fsdp": Run("fsdp", [*CROSS, *BLOCKS, "--resume"], rewound_from=("gpt/ddp2", 10)),
    "cross-ddp": Run("ddp", [*CROSS, "--resume"], nproc=2, rewound_from=("gpt/fsdp2", 10)),
    "text-ref": Run("ddp", [*TEXT_RUN, *ONE_THREAD], nproc=1),
    "text-ddp2": Run("ddp", TEXT_RUN, nproc=2),
}
PARITY_RUNS = ("ddp2", "ddp4", "fsdp2", "fsdp4", "fsdp2-ac")


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "gpt"


def hits(out: Path, positions: int) -> int:
    """The test positions the run's last evaluation predicted right: a whole number, or a position was left out."""
    accuracy = read_run(out)["final"]["test_accuracy"]
    assert round(accuracy * positions) == pytest.approx(accuracy * positions, abs=1e-6), accuracy
    return round(accuracy * positions)


def baby_gpt():
    """The runs' model at its initial weights (the seed's), for the copy task's vocabulary of 128."""
    from common.model import build_model

    return build_model(model="gpt", seed=0, dropout=0.0, heads=0, kv_heads=0, vocab_size=128, seq_len=SEQ_LEN)


@pytest.mark.parametrize("name", tiered(PARITY_RUNS, POOLED))
def test_ddp_and_fsdp_follow_one_process(runs, name):
    assert len(losses(runs / name)) == (10 if name.endswith("-ac") else STEPS)
    assert_follows(runs / name, runs / "ref", **FOLLOWS)
    run = read_run(runs / name)
    assert run["model"] == {"size": "baby", "parameters": 123_200} and run["config"]["model"] == "gpt"
    assert run["world_size"] == int(name[len("ddp") if name.startswith("ddp") else len("fsdp")])
    # the evaluation after the last step, through the strategy's own forward: the same predictions (the reference
    # evaluates after step 10 too)
    (evaluation,) = [e for e in read_metrics(runs / name)[1] if e["step"] == len(losses(runs / name))]
    (reference,) = [e for e in read_metrics(runs / "ref")[1] if e["step"] == evaluation["step"]]
    assert round(evaluation["test_accuracy"] * SCORED) == round(reference["test_accuracy"] * SCORED)
    assert round(evaluation["test_accuracy"] * SCORED) == pytest.approx(evaluation["test_accuracy"] * SCORED)


@pytest.mark.parametrize("name, ranks", [("fsdp2", 2), ("fsdp4", 4)])
def test_fsdp_shards_every_parameter_over_the_ranks(runs, name, ranks):
    """Fully sharded: each rank keeps 1/ranks of every parameter, gradient and AdamW moment (every dimension of
    BabyGPT's baby splits evenly over 2 and 4), a unit per block."""
    run = read_run(runs / name)
    assert run["config"]["sharding"] == "full" and run["config"]["shard_units"] == "blocks"
    assert run["mesh"] == {"shard": ranks}
    assert [rank["rank"] for rank in run["memory"]["per_rank"]] == list(range(ranks))
    tensors = len(list(baby_gpt().parameters()))
    for rank in run["memory"]["per_rank"]:
        assert rank["param_bytes"] == rank["grad_bytes"] == 4 * 123_200 // ranks, rank
        # AdamW's two moments of this rank's shard, and a 4-byte step counter per tensor
        assert rank["optim_bytes"] == 2 * rank["param_bytes"] + 4 * tensors, rank


def test_fsdp_gathers_a_unit_per_block_and_ddp_all_reduces_the_gradient(runs):
    """The collectives the profiler counted in step 3 on every rank: FSDP all-gathers the root (embedding and head),
    block0 and block1 before forward, and block0 again before its backward (resharded after forward; block1, the last
    unit, and the root keep theirs), and reduce-scatters each unit's gradient once; DDP all-reduces the whole
    gradient."""
    model = baby_gpt()
    n_params = sum(p.numel() for p in model.parameters())
    block0 = sum(p.numel() for p in model.block0.parameters())
    fsdp, ddp = (read_run(runs / name)["profile"]["per_rank"] for name in ("fsdp2", "ddp2"))
    assert len(fsdp) == len(ddp) == 2  # every rank reported
    for rank in fsdp:
        assert rank["traffic"] == {
            "all_gather": {"calls": 4, "elements": n_params + block0},
            "reduce_scatter": {"calls": 3, "elements": n_params},
        }, rank
    for rank in ddp:
        assert set(rank["traffic"]) == {"all_reduce"} and rank["traffic"]["all_reduce"]["elements"] == n_params, rank


@pytest.mark.parametrize("name", ["fsdp2-ac", "fsdp2-bf16-ac"])
def test_checkpointing_recomputes_each_block_in_the_compute_dtype(runs, name):
    """Each block is wrapped before fully_shard: inside backward its layers run again, all but the MLP's last
    (`down`: its output is not needed, and the recomputation stops once backward has what it needs); the embedding
    and the head, outside any block, do not. Under bf16 mixed precision every layer computes in bf16, the
    recomputed ones too."""
    dtype = "torch.bfloat16" if "bf16" in name else "torch.float32"
    probes = observed(runs / name)
    assert len(probes) == 2  # both ranks
    for rank in probes:
        # per step: the embedding, 9 layers in each of the 2 blocks (norm1, q, k, v, o, norm2, gate, up, down),
        # the head's norm and output layer; 8 of each block's recomputed
        assert rank["calls"] == {"forward": 10 * (1 + 2 * 9 + 2), "recomputed": 10 * 2 * 8}, rank["calls"]
        assert rank["dtypes"] == {"Embedding": [dtype], "RMSNorm": [dtype], "Linear": [dtype]}, rank
        assert rank["recomputed_dtypes"] == {"RMSNorm": [dtype], "Linear": [dtype]}, rank
    # without the flag nothing runs inside backward
    assert [rank["calls"]["recomputed"] for rank in observed(runs / "fsdp2")] == [0, 0]


def test_bf16_follows_fp32_within_a_measured_band(runs):
    """Mixed precision against the same run in fp32: its rounding shows in the gradient from the first step (fp32 on
    one process and on two are ~1e-9 apart there), and the curves stay within 10x of what was measured. (The loss
    barely sees it: at the initial weights' small logits every prediction is near uniform.)"""
    bf16, fp32 = runs / "fsdp2-bf16-ac", runs / "fsdp2-ac"
    norms = [abs(a - b) / b for a, b in zip(grad_norms(bf16), grad_norms(fp32))]
    assert norms[0] >= 1e-5 and max(norms) <= BF16_BAND["grad_norm"], norms
    assert max_abs_diff(losses(bf16), losses(fp32)) <= BF16_BAND["loss"]


@pytest.mark.parametrize("name", ["ddp2", "fsdp2"])
def test_a_resumed_run_repeats_the_run_bit_for_bit(runs, name):
    """Steps 11-20 again, resumed from the step-10 checkpoint: every loss and every gradient norm equal, where a
    difference in rounding alone shows in the float64 norm (one against two processes: 1e-9 relative at step 1)."""
    again = runs / f"{name}-resumed"
    assert_resumed(again, 10, printed(again), source=runs / name)
    assert losses(again) == losses(runs / name) and grad_norms(again) == grad_norms(runs / name)


@pytest.mark.parametrize("name, source, ranks", [("cross-fsdp", "ddp2", 4), ("cross-ddp", "fsdp2", 2)])
def test_a_checkpoint_crosses_between_ddp_and_fsdp(runs, name, source, ranks):
    """FSDP on 4 ranks loads DDP's whole tensors of step 10 as its shards, DDP on 2 FSDP's shards as whole tensors
    (the model and AdamW's moments: restarting them would move the curve by far more), and the curve goes on as
    one process's."""
    assert_resumed(runs / name, 10, printed(runs / name), source=runs / source)
    run = read_run(runs / name)
    assert (run["strategy"], run["world_size"]) == (name.split("-")[1], ranks)
    assert len(losses(runs / name)) == STEPS
    assert_follows(runs / name, runs / "ref", steps=range(11, STEPS + 1), **FOLLOWS)


def test_the_loss_scores_the_copied_half_alone(runs):
    """The first step's loss, recomputed here from the initial weights and the first global batch: the mean
    cross-entropy over the positions whose next token is a copied one, not over every position."""
    from common.cli import parse_config
    from common.data import GlobalBatchSampler, load_dataset

    cfg = parse_config("ddp", [*PARITY, "--out", "unused"])
    data = load_dataset(cfg)
    first = GlobalBatchSampler(len(data.train), 32, seed=0).global_batch(1)
    tokens, targets = data.train.images[first], data.train.labels[first]
    with torch.no_grad():
        log_probs = baby_gpt()(tokens).log_softmax(dim=-1)
    scored = targets != -100
    assert scored.sum() == 32 * SEQ_LEN // 2 and scored[:, -1].sum() == 0  # the copied half; the last predicts none
    picked = log_probs[scored].gather(1, targets[scored][:, None])
    expected = -picked.mean().item()
    # every position scored (the first half's targets as token 0): the difference the check must see
    everywhere = -log_probs.gather(2, targets.clamp(min=0)[..., None]).mean().item()
    assert abs(everywhere - expected) > 100 * 1e-6
    assert losses(runs / "ref")[0] == pytest.approx(expected, abs=1e-6)


def test_the_evaluation_scores_the_copied_half_alone(runs):
    """FSDP's model.pt (the trained weights, gathered whole) evaluated here on the test split's copied positions:
    the loss and the hits the run reported."""
    from common.cli import parse_config
    from common.data import load_dataset

    model = baby_gpt()
    model.load_state_dict(torch.load(runs / "fsdp2" / "model.pt", weights_only=True))
    data = load_dataset(parse_config("fsdp", [*PARITY, "--out", "unused"]))
    tokens, targets = data.test.images, data.test.labels
    with torch.no_grad():
        logits = model.eval()(tokens)
    scored = targets != -100
    logits, targets = logits[scored], targets[scored]
    assert len(targets) == SCORED
    final = read_run(runs / "fsdp2")["final"]
    assert torch.nn.functional.cross_entropy(logits, targets).item() == pytest.approx(final["test_loss"], abs=1e-5)
    assert (logits.argmax(dim=1) == targets).sum().item() == hits(runs / "fsdp2", SCORED)


def test_a_text_file_trains_on_two_ranks_as_on_one(runs):
    """--data-file: the file's bytes, a vocabulary of 256 (the embedding and the output layer 256 rows each), every
    next byte scored; DDP on 2 ranks follows one process and predicts the same test bytes."""
    cut = int(len(TEXT) * 0.9)  # the last 10 % is the test split; a sequence needs its next byte
    train_sequences, test_positions = (cut - 1) // SEQ_LEN, (len(TEXT) - cut - 1) // SEQ_LEN * SEQ_LEN
    line = f"text: {train_sequences} train / {test_positions // SEQ_LEN} test sequences of {SEQ_LEN} tokens"
    for name, ranks in (("text-ref", 1), ("text-ddp2", 2)):
        assert line in printed(runs / name), printed(runs / name)[-2000:]
        run = read_run(runs / name)
        assert (run["config"]["dataset"], run["config"]["data_file"]) == ("text", str(TEXT_FILE))
        assert run["model"]["parameters"] == 123_200 + 2 * 128 * 64 and run["world_size"] == ranks
        assert len(losses(runs / name)) == TEXT_STEPS
    assert_follows(runs / "text-ddp2", runs / "text-ref", **FOLLOWS)
    assert hits(runs / "text-ddp2", test_positions) == hits(runs / "text-ref", test_positions)
