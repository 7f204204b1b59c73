"""DDP on real processes (gloo): loss parity with one process, accumulation, the runner with a SIGKILLed
worker restarted, damaged checkpoints, two torchrun agents, bad input."""

import math
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.helpers import (
    KINK,
    ONE_THREAD,
    PARITY,
    PARITY_STEPS,
    PP_PARITY,
    ROOT,
    SGD,
    SGD_FOLLOWS,
    SMALL,
    TEST_SIZE,
    Run,
    assert_follows,
    assert_resumed,
    env_for_tests,
    free_port,
    kill_a_worker_when,
    last_logged_step,
    launch,
    losses,
    observed,
    printed,
    read_metrics,
    read_run,
    run_command,
    start_runner,
)

TEN = ["--checkpoint-every", "10"]  # checkpoints after steps 10, 20 and 30
# |Δloss| and relative |Δgrad_norm| against one process, AdamW: ~10x the 5.4e-7 and 1.9e-6 measured before step 29 in
# every comparison that reads it (3 ranks accumulating, at steps 28 and 25; 2-core AMD EPYC Zen 4, torch 2.14.1,
# 2026-12-03), and from step 29 on helpers.KINK's, where on a Zen 5 a ReLU's or the max pool's input crossed its kink
# in one run only (1.2e-6 and 2.2e-6 here at steps 29-30, no kink); SGD's: helpers.SGD_FOLLOWS
FOLLOWS = {"loss": 5e-6, "grad_norm": 2e-5, **KINK}
# the same, with weight decay 10 on 2 ranks over 20 steps: 2.1e-6 and 1.7e-5 measured (steps 18 and 20, the same
# machine and day), as on a Xeon (1.9e-6 and 1.7e-5 on 4 ranks)
DECAY_FOLLOWS = {"loss": 1e-5, "grad_norm": 1e-4}
# AdamW's decoupled weight decay, strong enough to move the curve within 20 steps at --lr 1e-4
DECAY = [*PARITY, "--max-steps", "20", "--weight-decay", "10"]


# Trainings in the shared launches (tests/integration/conftest.py)
POOLED = {
    "ddp4": Run("ddp", PARITY),
    # 2001 test images: shards of 500, 500, 500 and 501, so the last rank needs one batch more
    "sgd4": Run("ddp", [*PARITY, *SGD, "--checkpoint-every", "6", "--keep", "2", "--test-size", "2001"]),
    "ddp3_accum": Run("ddp", [*PARITY, "--grad-accum-steps", "2"], nproc=3),
    # dropout on (the default 0.1): each rank its own masks, seen by probes (tests/integration/workers/observe.py)
    "seeding3": Run("ddp", [*SMALL, "--max-steps", "2", "--batch-size", "48"], nproc=3, observe=True),
    "decay2": Run("ddp", DECAY, nproc=2),  # (every rank's update decays on 2 as on 4: 4 processes cost 2 cores ~2x)
    "decay": Run("ddp", [*DECAY, *ONE_THREAD], nproc=1),  # on the reference's thread: its first step is adamw's
    # the 1-process run's step-12 checkpoint resumed on 4 ranks (in a copy of that run as it stood then)
    "from1": Run("ddp", [*PP_PARITY, "--resume"], rewound_from=("references/pipeline", 12)),
}


@pytest.fixture(scope="session")  # (its tests run on both sides of the shared launches: set up once)
def runner2(tmp_path_factory) -> tuple[Path, str]:
    """run_ddp.sh on 2 processes with MAX_RESTARTS=1, one worker SIGKILLed after step 10: (the run folder,
    what the runner printed)."""
    out = tmp_path_factory.mktemp("ddp") / "runner2"
    runner = start_runner("ddp", [*PARITY, *TEN], out, NPROC="2", MAX_RESTARTS="1")
    _, printed = kill_a_worker_when(runner, out, 2, lambda: last_logged_step(out) > 10)
    assert runner.returncode == 0, printed[-4000:]
    return out, printed


@pytest.fixture(scope="module")
def runs(pool, references, runner2):
    """The pooled runs, the 1-process references (shared with test_fsdp.py) and the runner's run."""
    return {**references, **{name: pool / "ddp" / name for name in POOLED}, "runner2": runner2[0]}


def test_four_ranks_match_one_process_adamw(runs):
    ref = losses(runs["adamw"])
    assert len(ref) == PARITY_STEPS and ref[-1] < ref[0] * 0.7, "the reference run should learn"
    assert_follows(runs["ddp4"], runs["adamw"], **FOLLOWS)


def test_three_ranks_with_gradient_accumulation_match_one_process(runs):
    # grad_norm too: a sum of accumulated gradients off by a constant factor would hide in AdamW's loss
    assert_follows(runs["ddp3_accum"], runs["adamw"], **FOLLOWS)


def test_weight_decay_takes_effect_on_every_rank(runs):
    assert_follows(runs["decay2"], runs["decay"], **DECAY_FOLLOWS)
    # the same 20 steps without decay end elsewhere (the first step's loss precedes any decay): 2.3e-2 apart
    plain, decayed = losses(runs["adamw"])[:20], losses(runs["decay"])
    assert plain[0] == decayed[0] and abs(plain[-1] - decayed[-1]) > 100 * DECAY_FOLLOWS["loss"]


def test_a_sigkilled_worker_is_restarted_and_the_run_resumes(runner2):
    """torchrun restarted the group (the runner exited 0), and the new workers resumed by themselves from
    the latest checkpoint; every step is logged once (losses() fails otherwise)."""
    out, output = runner2
    resumed = re.search(r"resumed from \S+ \(step (\d+)\)", output)
    assert resumed and resumed.group(1) in ("10", "20"), output[-3000:]
    assert_resumed(out, int(resumed.group(1)), output)
    assert len(losses(out)) == PARITY_STEPS


def test_runner_two_ranks_match_and_write_the_metrics_contract(runs):
    """run_ddp.sh on 2 processes, through the restart: the curve and every record of the metrics contract."""
    out = runs["runner2"]
    assert_follows(out, runs["adamw"], **FOLLOWS)
    train, evals = read_metrics(out)
    for record in train.values():
        assert set(record) == {"kind", "step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s"}
        assert record["samples_per_s"] > 0 and record["step_time_s"] > 0 and math.isfinite(record["loss"])
    assert [r["lr"] for r in train.values()][:5] == pytest.approx([1e-4 * s / 4 for s in (1, 2, 3, 4)] + [1e-4])
    assert len(evals) == 1 and evals[0]["step"] == PARITY_STEPS and 0 < evals[0]["test_accuracy"] <= 1
    run = read_run(out)
    assert (run["strategy"], run["world_size"], run["backend"], run["device"]) == ("ddp", 2, "gloo", "cpu")
    assert run["config"]["batch_size"] == 48 and "sharding" not in run["config"]
    assert run["final"]["test_accuracy"] == evals[0]["test_accuracy"]
    assert run["final"]["train_loss"] == train[PARITY_STEPS]["loss"]
    assert [m["rank"] for m in run["memory"]["per_rank"]] == [0, 1]
    for m in run["memory"]["per_rank"]:
        # DDP: a full replica of the 1.27M fp32 parameters, their gradients and AdamW's two moments
        assert m["param_bytes"] == m["grad_bytes"] > 4 * 1_200_000
        assert m["optim_bytes"] >= 2 * m["param_bytes"]
        assert m["cuda_peak_bytes"] is None


def test_a_one_process_checkpoint_resumes_on_four_ranks(runs):
    # DDP's state is the whole model and optimizer on every rank: a checkpoint loads at any world size, and
    # the same global batches continue the curve
    assert_resumed(runs["from1"], 12, printed(runs["from1"]), source=runs["pipeline"])
    train, _ = read_metrics(runs["from1"])
    assert sorted(train) == list(range(1, 21)) and read_run(runs["from1"])["world_size"] == 4
    assert_follows(runs["from1"], runs["pipeline"], **FOLLOWS, steps=range(13, 21))


def test_evaluation_covers_the_whole_test_set_the_same_way_at_any_world_size(runs):
    accuracies = {name: read_metrics(runs[name])[1][-1]["test_accuracy"] for name in ("adamw", "ddp4", "ddp3_accum")}
    # TEST_SIZE test images: the same predictions give the same count of hits, whatever the sharding
    assert len({round(a * TEST_SIZE) for a in accuracies.values()}) == 1, accuracies
    assert all(round(a * TEST_SIZE) == a * TEST_SIZE for a in accuracies.values())


def test_evaluation_counts_every_image_when_the_shards_differ(runs):
    (evaluation,) = read_metrics(runs["sgd4"])[1]
    hits = evaluation["test_accuracy"] * 2001  # a whole number only if all 2001 images were counted
    assert hits == pytest.approx(round(hits), abs=1e-6) and 0 < hits < 2001


def test_sgd_matches_one_process(runs):
    # the tolerance means something only where the reference itself is stable at that tolerance
    assert_follows(runs["sgd_1thread"], runs["sgd"], **SGD_FOLLOWS)
    assert_follows(runs["sgd4"], runs["sgd"], **SGD_FOLLOWS)


def test_keep_deletes_all_but_the_newest_checkpoints(runs):
    assert sorted(p.name for p in (runs["sgd4"] / "checkpoints").iterdir()) == ["step_0000024", "step_0000030"]


def test_ranks_share_weights_but_not_dropout_masks(runs):
    # a real DDP training on 3 ranks, seen by probes: the script re-seeds each rank with seed + rank after
    # building the model, so the first dropout masks differ; the weights its layers run are the same
    ranks = observed(runs["seeding3"])
    assert [rank["dropout"]["seed"] for rank in ranks] == [0, 1, 2]
    assert len({rank["dropout"]["mask"] for rank in ranks}) == 3
    assert ranks[0]["first_weights"] == ranks[1]["first_weights"] == ranks[2]["first_weights"]


# --------------------------------------------------------------------------------------------- bad input
# No network, at once: every download is refused by a proxy that is not there (without one, an offline machine's
# failed name lookups kept the test waiting ~20 s)
OFFLINE = {"https_proxy": "http://127.0.0.1:9", "http_proxy": "http://127.0.0.1:9", "no_proxy": ""}
BAD_INPUT = [
    (["--dataset", "imagenet"], {}, "--dataset"),
    (["--optimizer", "lamb"], {}, "--optimizer"),
    (["--lr", "0"], {}, "--lr"),
    (["--lr", "fast"], {}, "--lr"),
    (["--epochs", "two"], {}, "--epochs"),
    (["--max-steps", "-3"], {}, "--max-steps"),
    (["--batch-size", "130"], {}, "--batch-size"),  # 4 processes do not divide 130
    ([], {"NPROC": "3"}, "--batch-size"),  # 3 processes do not divide 128
    (["--no-such-flag"], {}, "--no-such-flag"),
    ([], {"NPROC": "four"}, "NPROC"),
    ([], {"MAX_RESTARTS": "-1"}, "MAX_RESTARTS"),
    ([], {"PYTHON": "/no/such/python"}, "PYTHON=/no/such/python: no such program"),
    ([], {"NNODES": "2"}, "NODE_RANK"),
    ([], {"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR"),
    (["--dataset", "mnist", "--data-dir", "{tmp}/mnist"], OFFLINE, "--data-dir"),  # not on disk, not downloadable
    (["--train-size", "64"], {}, "--batch-size"),  # the global batch 128 does not fit in 64 images
    (["--precision", "fp16", "--loss-scale", "1000"], {}, "--loss-scale"),  # not a power of two
    (["--model", "transformer"], {}, "--model"),
    (["--model", "vit", "--heads", "5"], {}, "--heads"),  # the width 64 in 5 heads
    (["--model", "vit", "--model-size", "b16"], {}, "--patch-size"),  # a published ViT: patch 16, images of 28
    (["--patch-size", "7"], {}, "--patch-size"),  # a flag of the ViT given to BabyCNN
    (["--device", "cuda"], {"NPROC": "2"}, "--device cuda"),  # more processes than GPUs (the tests see none)
]


@pytest.mark.parametrize("flags,env,named", BAD_INPUT, ids=[str(b[2]) + str(i) for i, b in enumerate(BAD_INPUT)])
def test_runner_rejects_bad_input_with_one_line(flags, env, named, tmp_path):
    proc = run_command(
        ["bash", "run_ddp.sh", *(flag.format(tmp=tmp_path) for flag in flags), "--out", str(tmp_path / "out")],
        env={**env_for_tests(), **env},
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not (tmp_path / "out").exists(), "nothing may start before the input is valid"


@pytest.mark.parametrize("where", ["a file", "under a file", "not writable"])
def test_an_out_that_cannot_be_written_is_refused_before_torchrun(where, tmp_path):
    """A file in --out's place, or a folder this process cannot create files in (/sys: a file system that refuses
    new files even to root, as a read-only mount does): one line, exit 2, nothing started or written."""
    (tmp_path / "file").write_text("a user's file\n")
    out = {"a file": tmp_path / "file", "under a file": tmp_path / "file" / "run", "not writable": "/sys/babycnn"}[
        where
    ]
    proc = run_command(["bash", "run_ddp.sh", "--out", str(out)], check=False, timeout=60)
    assert proc.returncode == 2 and proc.stdout == "", proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"error: --out {out}: ") and ("is a file, not a folder" in line or "cannot write in" in line)
    assert (tmp_path / "file").read_text() == "a user's file\n" and sorted(p.name for p in tmp_path.iterdir()) == [
        "file"
    ]


def test_a_data_set_smaller_than_one_global_batch_is_one_line(tmp_path):
    proc = launch("train_ddp.py", 2, ["--train-size", "64", "--batch-size", "128"], tmp_path, check=False, timeout=120)
    # plain torchrun, not a runner: it exits 1 for any failed worker and reports it with its own traceback (from its
    # own files, which may live in a .venv or .venv-floor inside the checkout); no frame of this project's code may
    # appear, and its table gives the worker that said it (rank 0, or one alone in its error) bad input's exit code 2
    assert proc.returncode == 1 and not re.search(rf'File "{re.escape(str(ROOT))}/(?!\.venv)', proc.stderr)
    assert re.search(r"Root Cause.*?exitcode\s*:\s*2 ", proc.stderr, re.S), proc.stderr[-2000:]
    assert "error: --batch-size: the global batch 128 is larger than the training set (64 samples)" in proc.stderr


def test_plain_python_rejects_bad_input_with_one_line(tmp_path):
    proc = run_command([sys.executable, "train_ddp.py", "--lr", "-1", "--out", str(tmp_path)], check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --lr: must be a positive number, got -1.0"
    ], proc.stderr
    # a worker that finds no GPU for --device cuda (the tests hide any): one line, from the worker itself
    proc = run_command(
        [sys.executable, "train_ddp.py", "--device", "cuda", "--out", str(tmp_path / "cuda")], check=False, timeout=60
    )
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --device cuda: local rank 0 has no GPU (0 visible); launch fewer processes per machine, "
        "or use --device cpu"
    ], proc.stderr


def test_help_lists_flags_with_their_docs():
    proc = run_command([sys.executable, "train_ddp.py", "--help"], timeout=60)
    assert "GLOBAL batch size" in proc.stdout and "--grad-accum-steps" in proc.stdout


# --------------------------------------------------------------------------------------------- checkpoints
# (these read the runner's run alone, no shared launch: they run beside the launches, not after them)
def _damaged_copy(runner2, tmp_path, damage):
    """A copy of the 2-rank run folder (checkpoints at steps 10, 20 and 30) with its step-30 checkpoint damaged."""
    out = tmp_path / "run"
    shutil.copytree(runner2[0], out)
    shard = sorted((out / "checkpoints" / "step_0000030").glob("*.distcp"))[0]
    damage(shard)
    return out


def test_a_truncated_checkpoint_is_detected_and_skipped_loudly(runner2, tmp_path):
    from common.resume import latest_checkpoint, verify_checkpoint

    out = _damaged_copy(runner2, tmp_path, lambda f: f.write_bytes(f.read_bytes()[:1000]))
    problem = verify_checkpoint(str(out / "checkpoints" / "step_0000030"))
    assert problem and "truncated" in problem
    warnings = []
    assert latest_checkpoint(str(out), log=warnings.append) == str(out / "checkpoints" / "step_0000020")
    assert len(warnings) == 1 and "step_0000030 is damaged" in warnings[0]


def test_resume_skips_a_corrupted_checkpoint_and_continues_exactly(runner2, tmp_path):
    """--resume in a new launch: the newest checkpoint (step 30) fails its checksum, so the run resumes from
    step 20 and repeats steps 21-30 of the uninterrupted run."""

    def flip_a_byte(f):
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0xFF
        f.write_bytes(bytes(data))

    out = _damaged_copy(runner2, tmp_path, flip_a_byte)
    before = read_metrics(out)[0]
    proc = launch("train_ddp.py", 2, [*PARITY, "--resume"], out)
    assert "step_0000030 is damaged" in proc.stdout and "does not match its checksum" in proc.stdout
    assert_resumed(out, 20, proc.stdout)
    assert [read_metrics(out)[0][s] for s in range(1, 21)] == [before[s] for s in range(1, 21)]
    assert (out / "checkpoints" / "step_0000030").exists(), "a damaged checkpoint is never deleted"
    assert losses(out) == losses(runner2[0])  # the same 30 steps, each once: bit for bit


def test_resume_refuses_when_every_checkpoint_is_damaged(runner2, tmp_path):
    out = _damaged_copy(runner2, tmp_path, lambda f: f.write_bytes(b""))
    for meta in (out / "checkpoints").glob("*/meta.json"):
        meta.write_text("{")
    proc = launch("train_ddp.py", 1, [*PARITY, "--resume"], out, check=False)
    # bad input (nothing to resume from): one line, exit 2; the warnings about each damaged checkpoint go to stdout
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: --resume: no checkpoint in"), (
        proc.stderr
    )
    assert "passes verification" in lines[0] and "Traceback" not in proc.stdout
    assert (out / "checkpoints" / "step_0000010").exists(), "a damaged checkpoint is never deleted"
    # the same through the runner, whose preflight reads no meta.json here: it leaves the run where it is (moved
    # aside, a fresh run would start) for its worker to refuse, in the same line
    runner = run_command(
        ["bash", "run_ddp.sh", *PARITY, "--resume", "--out", str(out)],
        env={**env_for_tests(), "NPROC": "1"},
        check=False,
    )
    assert runner.returncode == 2 and runner.stderr.splitlines() == lines, runner.stdout[-2000:] + runner.stderr
    assert not Path(f"{out}.1").exists() and (out / "checkpoints" / "step_0000010").exists()


# --------------------------------------------------------------------------------------------- several machines
def test_two_torchrun_agents_reproduce_the_single_agent_curve(runs, tmp_path):
    """NNODES=2: two runners, a process each (a worker's start costs more than its 12 steps here), meeting through
    the c10d rendezvous as two machines would."""
    import subprocess

    env = {**env_for_tests(), "NNODES": "2", "NPROC": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    cmd = ["bash", "run_ddp.sh", *PARITY, "--max-steps", "12", "--out", str(tmp_path / "out")]
    agents = [
        subprocess.Popen(
            cmd, env={**env, "NODE_RANK": str(n)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        for n in (0, 1)
    ]
    try:
        outputs = [agent.communicate(timeout=240)[0] for agent in agents]
    finally:
        for agent in agents:
            agent.kill()
    assert [agent.returncode for agent in agents] == [0, 0], outputs
    run = read_run(tmp_path / "out")
    assert run["world_size"] == 2 and [rank["rank"] for rank in run["memory"]["per_rank"]] == [0, 1]
    assert_follows(tmp_path / "out", runs["adamw"], **FOLLOWS, steps=range(1, 13))


def test_a_diverging_run_stops_naming_the_step_and_keeps_its_last_checkpoint(tmp_path):
    proc = launch(
        "train_ddp.py",
        2,
        [*PARITY, "--optimizer", "sgd", "--lr", "1e30", "--warmup-steps", "0", "--checkpoint-every", "1"],
        tmp_path,
        check=False,
    )
    # not bad input but a run that failed: each rank exits 1 naming itself (common/distributed.py's `run`), and plain
    # torchrun exits 1 for any failed worker; its table names the root cause with that exit code
    assert proc.returncode == 1 and re.search(r"Root Cause.*?exitcode\s*:\s*1 ", proc.stderr, re.S), proc.stderr[-2000:]
    assert re.search(
        r"\[rank \d\] error: the (loss is nan|loss is inf|weights are not finite) (at|after) step \d+", proc.stderr
    ), proc.stderr[-2000:]
    from common.resume import latest_checkpoint

    assert latest_checkpoint(str(tmp_path)) is not None, "the last good checkpoint must survive"
