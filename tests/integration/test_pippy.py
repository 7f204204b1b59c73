"""Pipeline parallelism on real processes (gloo): every schedule against one process, evaluation over the
whole test set, pipeline x data parallel, checkpoints across strategies, the bubble report, the runner, and
bad combinations rejected in one line before anything trains."""

import json
import re
import shutil
import sys

import pytest

from tests.helpers import (
    PP_PARITY,
    Run,
    env_for_tests,
    kill_a_worker_when,
    last_logged_step,
    launch,
    losses,
    max_abs_diff,
    read_metrics,
    read_run,
    run_command,
    start_runner,
)

STEPS = 20  # PP_PARITY's
# The schedule matrix runs the first 10 of them: after the 4 warm-up steps the rate is constant, so a 10-step
# run is the 20-step run's prefix, and a schedule that orders its micro-batches or gradients wrongly is off
# from the first step. The reference also evaluates after step 10, for the matrix to compare its evaluation.
MATRIX_STEPS = 10
# Every schedule the README lists as working, with the stages per rank it runs.
STAGES_PER_RANK = {
    "gpipe": 1,
    "1f1b": 1,
    "interleaved-1f1b": 2,
    "looped-bfs": 2,
    "interleaved-zb": 2,
    "zbv": 2,
    "dualpipev": 2,
}
# On 4 ranks: each schedule at 4 and 8 micro-batches (dualpipev needs as many as its 8 stages; its 4 runs
# below on 2 ranks per pipeline, with --dp 2).
MATRIX = {
    f"{name}-m{m}": ["--schedule", name, "--stages-per-rank", str(v), "--n-microbatches", str(m)]
    for name, v in STAGES_PER_RANK.items()
    for m in (4, 8)
    if not (name == "dualpipev" and m < 8)
}
DP2 = {
    "dp2-1f1b-m4": ["--dp", "2", "--eval-every", "10"],  # evaluating mid-run, then training on
    "dp2-dualpipev-m4": ["--dp", "2", "--schedule", "dualpipev", "--stages-per-rank", "2"],
    "dp2-zbv-accum2": ["--dp", "2", "--schedule", "zbv", "--stages-per-rank", "2", "--grad-accum-steps", "2"],
}
# 8 stages on 4 ranks: pipeline rank 1 holds only relu1 and pool, no parameters and no optimizer
PART1 = ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--max-steps", "12", "--checkpoint-every", "12"]


# Trainings in the shared launches (tests/integration/conftest.py): each schedule at 4 and 8 micro-batches,
# the --dp 2 runs, the first half of a run to resume, and a pipeline resuming the 1-process DDP run's
# checkpoint (in a copy of that run as it stood after step 12)
POOLED = {
    **{name: Run("pippy", [*PP_PARITY, *flags, "--max-steps", str(MATRIX_STEPS)]) for name, flags in MATRIX.items()},
    **{name: Run("pippy", [*PP_PARITY, *flags]) for name, flags in {**DP2, "part1": PART1}.items()},
    "from-ddp": Run("pippy", [*PP_PARITY, "--dp", "2", "--resume"], rewound_from=("references/pipeline", 12)),
}


@pytest.fixture(scope="module")
def ref(references):
    """The 1-process run every pipeline run is compared with (with a checkpoint after step 12)."""
    return references["pipeline"]


@pytest.fixture(scope="module")
def pipelines(pool):
    assert f"resumed from {pool / 'pippy' / 'from-ddp'}/checkpoints/step_0000012 (step 12)" in pool.output
    return pool / "pippy"


def check_matches_reference(out, ref_out) -> None:
    reference, run_losses = losses(ref_out), losses(out)
    assert len(reference) == STEPS and reference[-1] < 0.7 * reference[0], "the reference run should learn"
    assert len(run_losses) in (MATRIX_STEPS, STEPS)
    assert max_abs_diff(run_losses, reference[: len(run_losses)]) <= 1e-4
    # evaluation ran through the pipeline over all 256 test images: the same predictions as the reference
    evaluation = read_metrics(out)[1][-1]
    (reference_eval,) = [e for e in read_metrics(ref_out)[1] if e["step"] == evaluation["step"] == len(run_losses)]
    assert round(evaluation["test_accuracy"] * 256) == round(reference_eval["test_accuracy"] * 256)
    assert evaluation["test_accuracy"] * 256 == pytest.approx(round(evaluation["test_accuracy"] * 256))
    assert evaluation["test_loss"] == pytest.approx(reference_eval["test_loss"], abs=1e-4)


@pytest.mark.parametrize("name", list(MATRIX))
def test_every_schedule_matches_one_process(name, pipelines, ref):
    check_matches_reference(pipelines / name, ref)


@pytest.mark.parametrize("name", list(DP2))
def test_pipeline_replicas_match_one_process(name, pipelines, ref):
    check_matches_reference(pipelines / name, ref)
    run = read_run(pipelines / name)
    assert run["config"]["dp"] == 2 and run["pipeline"]["pp_size"] == 2 and run["world_size"] == 4
    evaluated_at = [e["step"] for e in read_metrics(pipelines / name)[1]]
    assert evaluated_at == ([10, STEPS] if "--eval-every" in DP2[name] else [STEPS])


def test_the_rank_with_the_last_stage_logs_and_evaluation_method_is_recorded(pipelines):
    expected = {
        "1f1b-m4": (3, "schedule.eval()"),
        "interleaved-zb-m4": (3, "schedule.eval()"),
        "zbv-m4": (0, "stage by stage (send/recv)"),
        "dualpipev-m8": (0, "stage by stage (send/recv)"),
    }
    for name, (rank, evaluation) in expected.items():
        pipeline = read_run(pipelines / name)["pipeline"]
        assert (pipeline["logging_rank"], pipeline["evaluation"]) == (rank, evaluation), name
    assert read_run(pipelines / "dp2-1f1b-m4")["pipeline"]["logging_rank"] == 1  # replica 0 = ranks 0 and 1


def test_bubble_is_measured_per_rank_and_set_against_theory(pipelines):
    for m in (4, 8):
        out = pipelines / f"gpipe-m{m}"
        bubble = read_run(out)["pipeline"]["bubble"]
        assert bubble["formula"] == "(p-1)/(m+p-1)" and bubble["formula_value"] == pytest.approx(3 / (m + 3))
        assert bubble["theory"] == pytest.approx(3 / (m + 3))  # the executed order, simulated, agrees
        assert 0 < bubble["measured"] < 1 and len(bubble["busy_fraction_per_rank"]) == 4
        # conv2 holds ~88% of the work: stage imbalance alone idles the pipeline more than the fill and drain
        assert bubble["expected_from_stage_times"] > bubble["theory"]
        assert bubble["measured"] > bubble["theory"]
        lines = [json.loads(line) for line in (out / "bubble.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == list(range(1, MATRIX_STEPS + 1))
        assert all(len(r["busy_s"]) == len(r["idle_s"]) == 4 and min(r["busy_s"]) > 0 for r in lines)
    # more micro-batches, smaller bubble (in theory)
    theory = {name: read_run(pipelines / name)["pipeline"]["bubble"]["theory"] for name in MATRIX}
    for name in STAGES_PER_RANK:
        if name != "dualpipev":
            assert theory[f"{name}-m8"] < theory[f"{name}-m4"], name


def test_a_sigkilled_worker_is_restarted_and_the_run_resumes_exactly(pipelines, tmp_path):
    """run_pippy.sh end to end with MAX_RESTARTS=1: a worker SIGKILLed past the first checkpoint; torchrun
    restarts the group, whose new workers resume by themselves (one rank holds no parameters: relu1 and
    pool) and continue exactly as the uninterrupted run, each step logged once."""
    out = tmp_path / "killed"
    flags = [*PP_PARITY, *MATRIX["interleaved-1f1b-m4"], "--max-steps", str(MATRIX_STEPS), "--checkpoint-every", "4"]
    runner = start_runner("pippy", flags, out, NPROC="4", MAX_RESTARTS="1")
    _, output = kill_a_worker_when(runner, out, 4, lambda: last_logged_step(out) > 4)
    assert runner.returncode == 0, output[-4000:]
    assert re.search(r"resumed from \S+ \(step (4|8)\)", output), output[-3000:]
    assert max_abs_diff(losses(out), losses(pipelines / "interleaved-1f1b-m4")) <= 1e-6
    train, evals = read_metrics(out)
    assert all(
        set(r) == {"kind", "step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s"} for r in train.values()
    )
    run = read_run(out)
    assert (run["strategy"], run["world_size"], run["backend"]) == ("pippy", 4, "gloo")
    assert run["final"]["test_accuracy"] == evals[-1]["test_accuracy"]
    assert [m["rank"] for m in run["memory"]["per_rank"]] == [0, 1, 2, 3]
    assert run["memory"]["per_rank"][1]["param_bytes"] == 0  # relu1 and pool


def test_checkpoints_move_between_ddp_and_the_pipeline(pipelines, ref, tmp_path):
    # DDP's 12-step checkpoint resumed by 2 pipelines x 2 stages (FSDP2-sharded stages)
    assert max_abs_diff(losses(pipelines / "from-ddp"), losses(ref)) <= 1e-4
    # the pipeline's checkpoint (8 stages over 4 ranks) resumed by one DDP process
    out = tmp_path / "ddp-from-pipeline"
    shutil.copytree(pipelines / "part1", out)
    launch("train_ddp.py", 1, [*PP_PARITY, "--resume"], out)
    assert max_abs_diff(losses(out), losses(ref)) <= 1e-4


# --------------------------------------------------------------------------------------------- bad input
BAD = [  # (world size, flags, the flag the one line names, a word of the explanation)
    (4, ["--n-microbatches", "5"], "--n-microbatches", "does not divide"),
    (4, ["--dp", "2", "--batch-size", "100", "--n-microbatches", "4"], "--n-microbatches", "does not divide"),
    (4, ["--schedule", "1f1b", "--n-microbatches", "2"], "--n-microbatches", "at least as many"),
    (4, ["--schedule", "dualpipev", "--stages-per-rank", "2"], "--n-microbatches", "at least as many"),
    (
        4,
        ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--batch-size", "144", "--n-microbatches", "9"],
        "--n-microbatches",
        "rounds",
    ),
    (4, ["--schedule", "interleaved-1f1b", "--stages-per-rank", "3"], "--stages-per-rank", "at most 8"),
    (16, ["--n-microbatches", "16"], "--stages-per-rank", "at most 8"),
    (4, ["--schedule", "zbv"], "--stages-per-rank", "exactly 2"),
    (4, ["--schedule", "gpipe", "--stages-per-rank", "2"], "--stages-per-rank", "exactly 1"),
    (4, ["--schedule", "looped-bfs"], "--stages-per-rank", "2 or more"),
    (4, ["--dp", "3"], "--dp", "does not divide the world size"),
    (4, ["--dp", "4", "--batch-size", "130"], "--batch-size", "does not split"),
    (4, ["--schedule", "pipedream"], "--schedule", "unknown"),
]


@pytest.mark.parametrize("world,flags,named,why", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_preflight_rejects_bad_combinations_in_one_line(world, flags, named, why):
    proc = run_command(
        [sys.executable, "-m", "common.preflight", "pippy", "--world-size", str(world), *flags], check=False, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {named}:") and why in lines[0], lines[0]


def test_runner_and_script_reject_before_any_worker_trains(tmp_path):
    proc = run_command(
        ["bash", "run_pippy.sh", "--schedule", "1f1b", "--n-microbatches", "2", "--out", str(tmp_path / "a")],
        env={**env_for_tests(), "NPROC": "4"},
        check=False,
        timeout=60,
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines() == [
        "error: --n-microbatches: 1f1b needs at least as many micro-batches as stages (4), got 2"
    ]
    assert not (tmp_path / "a").exists(), "nothing may start before the input is valid"
    # the script checks the same on its own (one process: a pipeline of one rank)
    proc = run_command(
        [sys.executable, "train_pippy.py", "--schedule", "zbv", "--out", str(tmp_path / "b")], check=False, timeout=60
    )
    assert proc.returncode != 0 and proc.stderr.strip().splitlines()[-1].startswith("error: --stages-per-rank:")
    assert "Traceback" not in proc.stderr and not (tmp_path / "b").exists()
