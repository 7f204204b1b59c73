"""Pipeline parallelism on real processes (gloo): every schedule against one process, evaluation over the
whole test set, pipeline x data parallel, the order each schedule ran its actions in against the order it
prescribes, checkpoints across strategies, the bubble report, bf16, the runner, and bad combinations rejected in
one line before anything trains."""

import json
import re
import shutil
import sys
from itertools import combinations
from types import SimpleNamespace

import pytest

from common.pipeline_actions import BALANCED_COST, simulate_bubble
from common.versions import NEEDS_TP, NEEDS_V
from tests.helpers import (
    ONE_THREAD,
    PP_PARITY,
    TEST_SIZE,
    Run,
    assert_follows,
    assert_resumed,
    env_for_tests,
    kill_a_worker_when,
    last_logged_step,
    launch,
    losses,
    max_abs_diff,
    needs_torch,
    observed,
    printed,
    read_metrics,
    read_run,
    run_command,
    start_runner,
    tiered,
)

STEPS = 20  # PP_PARITY's
# |Δloss| and relative |Δgrad_norm| against one process: ~10x the 3.6e-7 and 3.8e-7 measured here
FOLLOWS = {"loss": 3e-6, "grad_norm": 3e-6}
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
    "dp2-1f1b-m4": ["--dp", "2", "--eval-every", "10"],  # evaluating mid-run, then training on: all 20 steps
    "dp2-dualpipev-m4": ["--dp", "2", "--schedule", "dualpipev", "--stages-per-rank", "2", "--max-steps", "10"],
    "dp2-zbv-accum2": ["--dp", "2", "--schedule", "zbv", "--stages-per-rank", "2", "--grad-accum-steps", "2"]
    + ["--max-steps", "10"],
}
# 8 stages on 4 ranks: pipeline rank 1 holds only relu1 and pool, no parameters and no optimizer
PART1 = ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2", "--max-steps", "12", "--checkpoint-every", "12"]


# The matrix's further points, the heavy tier's (`pytest -m heavy`): each schedule's 8 micro-batches after its 4, but
# GPipe's (the bubble's formula at two points) and DualPipeV's (its only run on 4 ranks)
MATRIX_HEAVY = {f"{name}-m8" for name in STAGES_PER_RANK} - {"gpipe-m8", "dualpipev-m8"}

# Trainings in the shared launches (tests/integration/conftest.py): each schedule at 4 and 8 micro-batches,
# the --dp 2 runs, the first half of a run to resume, and a pipeline resuming the 1-process DDP run's
# checkpoint (in a copy of that run as it stood after step 12)
POOLED = {
    **{
        name: Run("pippy", [*PP_PARITY, *flags, "--max-steps", str(MATRIX_STEPS)], heavy=name in MATRIX_HEAVY)
        for name, flags in MATRIX.items()
    },
    **{name: Run("pippy", [*PP_PARITY, *flags]) for name, flags in {**DP2, "part1": PART1}.items()},
    # 1f1b-m4's first steps in bf16, probes on (a few steps: what the layers return is bf16 from the first)
    "bf16-1f1b-m4": Run(
        "pippy", [*PP_PARITY, *MATRIX["1f1b-m4"], "--max-steps", "5", "--precision", "bf16"], observe=True
    ),
    "from-ddp": Run("pippy", [*PP_PARITY, "--dp", "2", "--resume"], rewound_from=("references/pipeline", 12)),
}


@pytest.fixture(scope="module")
def ref(references):
    """The 1-process run every pipeline run is compared with (with a checkpoint after step 12)."""
    return references["pipeline"]


@pytest.fixture(scope="module")
def pipelines(pool):
    return pool / "pippy"


def check_matches_reference(out, ref_out) -> None:
    reference, run_losses = losses(ref_out), losses(out)
    assert len(reference) == STEPS and reference[-1] < 0.7 * reference[0], "the reference run should learn"
    assert len(run_losses) in (MATRIX_STEPS, STEPS)
    # grad_norm too: a schedule that scaled every gradient by a constant factor would hide in AdamW's loss
    assert_follows(out, ref_out, **FOLLOWS)
    # evaluation ran through the pipeline over all TEST_SIZE test images: the same predictions as the reference
    evaluation = read_metrics(out)[1][-1]
    (reference_eval,) = [e for e in read_metrics(ref_out)[1] if e["step"] == evaluation["step"] == len(run_losses)]
    assert round(evaluation["test_accuracy"] * TEST_SIZE) == round(reference_eval["test_accuracy"] * TEST_SIZE)
    assert evaluation["test_accuracy"] * TEST_SIZE == pytest.approx(round(evaluation["test_accuracy"] * TEST_SIZE))
    assert evaluation["test_loss"] == pytest.approx(reference_eval["test_loss"], abs=1e-4)


@pytest.mark.parametrize("name", tiered(MATRIX, POOLED))
def test_every_schedule_matches_one_process(name, pipelines, ref):
    check_matches_reference(pipelines / name, ref)


# ------------------------------------------------------------------------------------- the schedule that ran
# What each --schedule must run, written here and not read from train_pippy.SCHEDULES, so that a wrong class there
# cannot move the expectation with it: GPipe and 1F1B written out (prescribed_orders), the multi-stage schedules as
# torch's own class computes them (its pipeline_order, which its runtime executes action by action on every rank)
TORCH_CLASS = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "looped-bfs": "ScheduleLoopedBFS",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
Order = list[tuple[int, str, int]]  # one rank's actions: (stage, kind F/B/I/W, micro-batch)


def prescribed_orders(schedule: str, *, p: int, v: int, m: int) -> list[Order]:
    """Each pipeline rank's actions of one schedule step, in the order `schedule` prescribes on p ranks with v
    stages each and m micro-batches."""
    if schedule == "gpipe":  # every forward, then every backward
        return [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    if schedule == "1f1b":  # p-1-r forwards to fill the pipeline, then one forward one backward, then the drain
        orders = []
        for r in range(p):
            warmup = min(p - 1 - r, m)
            steady = [action for i in range(m - warmup) for action in ((r, "F", warmup + i), (r, "B", i))]
            orders.append([(r, "F", i) for i in range(warmup)] + steady + [(r, "B", i) for i in range(m - warmup, m)])
        return orders
    from torch.distributed.pipelining import schedules as pp

    # rank 0's stages as stand-ins: the class computes every rank's actions from their count and the group's size
    held = [0, 2 * p - 1] if schedule in ("zbv", "dualpipev") else [k * p for k in range(v)]
    stages = [SimpleNamespace(stage_index=i, num_stages=p * v, group_size=p, group_rank=0, submod=None) for i in held]
    built = getattr(pp, TORCH_CLASS[schedule])(stages, n_microbatches=m, loss_fn=None, scale_grads=False)
    return [
        [
            (a.stage_index, a.computation_type.value, a.microbatch_index)
            for action in built.pipeline_order[r]
            if action is not None
            for a in (getattr(action, "sub_actions", None) or (action,))  # DualPipeV's overlapped F+B: both in turn
            if a.computation_type.value in ("F", "B", "I", "W")
        ]
        for r in range(p)
    ]


def recorded_orders(out) -> list[Order]:
    """What ran: each pipeline rank's actions of the run's last step, as run.json records them ("0F1")."""
    parse = lambda name: re.fullmatch(r"(\d+)([FBIW])(\d+)", name).groups()  # noqa: E731
    return [
        [(int(stage), kind, int(mb)) for stage, kind, mb in map(parse, order)]
        for order in read_run(out)["pipeline"]["bubble"]["orders"]
    ]


def schedule_of(name: str) -> tuple[str, int, int]:
    """(--schedule, --stages-per-rank, --n-microbatches) of a matrix run."""
    flags = dict(zip(MATRIX[name][::2], MATRIX[name][1::2]))
    return flags["--schedule"], int(flags["--stages-per-rank"]), int(flags["--n-microbatches"])


@pytest.mark.parametrize("name", tiered(MATRIX, POOLED))
def test_the_schedule_that_ran_is_the_one_named(name, pipelines):
    schedule, v, m = schedule_of(name)
    assert recorded_orders(pipelines / name) == prescribed_orders(schedule, p=4, v=v, m=m), name
    run = read_run(pipelines / name)
    pipeline = run["pipeline"]
    assert pipeline["bubble"]["same_order_every_step"] and pipeline["bubble"]["orders_step"] == MATRIX_STEPS
    assert run["config"]["schedule"] == schedule and pipeline["schedule_class"] == TORCH_CLASS[schedule]
    timeline = json.loads((pipelines / name / "timeline.json").read_text())
    assert timeline["orders"] == pipeline["bubble"]["orders"] and timeline["schedule"] == schedule


def test_the_schedule_that_ran_differs_between_every_two_schedules(pipelines, untrained):
    """At the same p and m no two schedules ran the same actions in the same order: none passes as another."""
    for m in (4, 8):
        trained = [name for name in MATRIX if name.endswith(f"-m{m}") and name not in untrained]
        ran = {name: recorded_orders(pipelines / name) for name in trained}
        assert len(ran) >= 2, f"m={m}: fewer than two schedules trained"
        for a, b in combinations(ran, 2):
            assert ran[a] != ran[b], f"{a} and {b} ran the same order"


@pytest.mark.parametrize("name", list(DP2))
def test_pipeline_replicas_match_one_process(name, pipelines, ref):
    check_matches_reference(pipelines / name, ref)
    run = read_run(pipelines / name)
    assert run["config"]["dp"] == 2 and run["pipeline"]["pp_size"] == 2 and run["world_size"] == 4
    evaluated_at = [e["step"] for e in read_metrics(pipelines / name)[1]]
    assert evaluated_at == ([10, STEPS] if "--eval-every" in DP2[name] else [MATRIX_STEPS])


def test_the_rank_with_the_last_stage_logs_and_evaluation_method_is_recorded(pipelines, untrained):
    expected = {
        "1f1b-m4": (3, "schedule.eval()"),
        "interleaved-zb-m4": (3, "schedule.eval()"),
        "zbv-m4": (0, "stage by stage (send/recv)"),
        "dualpipev-m8": (0, "stage by stage (send/recv)"),
    }
    for name, (rank, evaluation) in ((n, e) for n, e in expected.items() if n not in untrained):
        pipeline = read_run(pipelines / name)["pipeline"]
        assert (pipeline["logging_rank"], pipeline["evaluation"]) == (rank, evaluation), name
    assert read_run(pipelines / "dp2-1f1b-m4")["pipeline"]["logging_rank"] == 1  # replica 0 = ranks 0 and 1


def test_bubble_is_measured_per_rank_and_set_against_theory(pipelines, untrained):
    """run.json's bubble follows from what was recorded: the theory and the stage times' bubble simulate the orders
    that ran, the measured share is bubble.jsonl's busy and idle seconds; no duration is judged here."""
    trained = [name for name in MATRIX if name not in untrained]
    for name in trained:
        out, (schedule, v, m) = pipelines / name, schedule_of(name)
        bubble, orders = read_run(out)["pipeline"]["bubble"], recorded_orders(out)
        assert bubble["theory"] == simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]), name
        seconds = bubble["seconds_per_action"]  # each (stage, kind)'s measured mean
        from_stage_times = simulate_bubble(orders, lambda stage, kind, mean=seconds: mean[f"{stage}{kind}"])
        assert bubble["expected_from_stage_times"] == from_stage_times, name
        lines = [json.loads(line) for line in (out / "bubble.jsonl").read_text().splitlines()]
        assert [r["step"] for r in lines] == list(range(1, MATRIX_STEPS + 1))
        assert all(len(r["busy_s"]) == len(r["idle_s"]) == 4 and min(r["busy_s"]) > 0 for r in lines)
        # measured: the steps after the first (which also sets the pipeline up), every pipeline rank; bubble.jsonl
        # rounds each second to 1e-6, so a busy and a window sum differ from run.json's by at most 1e-6 a record
        busy = [sum(r["busy_s"][rank] for r in lines[1:]) for rank in range(4)]
        window = [sum(r["busy_s"][rank] + r["idle_s"][rank] for r in lines[1:]) for rank in range(4)]
        rounding = 2e-6 * 4 * (len(lines) - 1) / sum(window)
        assert bubble["measured"] == pytest.approx(1 - sum(busy) / sum(window), abs=rounding), name
        assert bubble["busy_fraction_per_rank"] == pytest.approx([b / w for b, w in zip(busy, window)], abs=rounding)
        assert bubble["steps_measured"] == MATRIX_STEPS - 1 and (bubble["p"], bubble["m"], bubble["v"]) == (4, m, v)
        formula, value = {
            "gpipe": ("(p-1)/(m+p-1)", 3 / (m + 3)),
            "1f1b": ("(p-1)/(m+p-1)", 3 / (m + 3)),
            "interleaved-1f1b": ("(p-1)/(v*m+p-1)", 3 / (v * m + 3)),
        }.get(schedule, (None, None))
        assert bubble["formula"] == formula, name
        if formula:  # the textbook's bubble is the simulation of the orders that ran
            assert bubble["formula_value"] == pytest.approx(value) and bubble["theory"] == pytest.approx(value)
    # more micro-batches, smaller bubble (in theory)
    theory = {name: read_run(pipelines / name)["pipeline"]["bubble"]["theory"] for name in trained}
    for name in STAGES_PER_RANK:
        if name != "dualpipev" and f"{name}-m8" in theory:
            assert theory[f"{name}-m8"] < theory[f"{name}-m4"], name


# The bf16 run against 1f1b-m4's first 5 steps (fp32, otherwise the same flags, the same pipeline): measured 2.1e-4
# apart at step 1 and 4.4e-4 at most over the 5 (2026-12-03, 2-core AMD EPYC Zen 4, torch 2.14.1); two fp32 runs of
# these flags agree to the bit
BF16_STEP1, BF16_MAX = 2e-3, 4e-3  # ~10x the measured


def test_bf16_computes_in_bf16_and_follows_fp32_closely(pipelines):
    # autocast around schedule.step(): on every pipeline rank the layers of its stage return bf16 (conv1; conv2 and
    # norm; fc1; fc2). Every rank also saw every layer return fp32 once, before training: stage_output_shapes runs
    # the whole model on one image to size evaluation's buffers, outside autocast.
    held = [{"Conv2d"}, {"Conv2d", "LayerNorm"}, {"Linear"}, {"Linear"}]
    ranks = observed(pipelines / "bf16-1f1b-m4")
    assert [{kind for kind, dtypes in rank["dtypes"].items() if "torch.bfloat16" in dtypes} for rank in ranks] == held
    bf16, fp32 = losses(pipelines / "bf16-1f1b-m4"), losses(pipelines / "1f1b-m4")[:5]
    assert len(bf16) == 5
    # apart from the first step (bf16 rounding reached the loss), but close: the same model learning the same way
    assert 1e-5 <= abs(bf16[0] - fp32[0]) <= BF16_STEP1 and max_abs_diff(bf16, fp32) <= BF16_MAX


def test_a_sigkilled_worker_is_restarted_and_the_run_resumes_exactly(pipelines, tmp_path):
    """run_pippy.sh end to end with MAX_RESTARTS=1: a worker SIGKILLed past the first checkpoint; torchrun
    restarts the group, whose new workers resume by themselves (one rank holds no parameters: relu1 and
    pool) and continue exactly as the uninterrupted run, each step logged once."""
    out = tmp_path / "killed"
    flags = [*PP_PARITY, *MATRIX["interleaved-1f1b-m4"], "--max-steps", str(MATRIX_STEPS), "--checkpoint-every", "4"]
    runner = start_runner("pippy", flags, out, NPROC="4", MAX_RESTARTS="1")
    _, output = kill_a_worker_when(runner, out, 4, lambda: last_logged_step(out) > 4)
    assert runner.returncode == 0, output[-4000:]
    resumed = re.search(r"resumed from \S+ \(step (4|8)\)", output)
    assert resumed, output[-3000:]
    assert_resumed(out, int(resumed.group(1)), output)
    assert losses(out) == losses(pipelines / "interleaved-1f1b-m4")  # bit for bit
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
    assert_resumed(pipelines / "from-ddp", 12, printed(pipelines / "from-ddp"), source=ref)
    assert_follows(pipelines / "from-ddp", ref, **FOLLOWS, steps=range(13, STEPS + 1))
    # the pipeline's checkpoint (8 stages over 4 ranks) resumed by one DDP process, on the reference's one thread
    out = tmp_path / "ddp-from-pipeline"
    shutil.copytree(pipelines / "part1", out)
    resumed = launch("train_ddp.py", 1, [*PP_PARITY, *ONE_THREAD, "--resume"], out)
    assert_resumed(out, 12, resumed.stdout, source=pipelines / "part1")
    assert_follows(out, ref, **FOLLOWS, steps=range(13, STEPS + 1))


# --------------------------------------------------------------------------------------------- an RGB data set
# Written into the workers' sitecustomize: the CIFAR-10 files below are the test's own, so the checksums torchvision
# keeps of the real ones cannot match; once torchvision.datasets.cifar is imported its two checks say yes, and
# everything else (reading the batches, the classes) is torchvision's own code.
ACCEPT_OUR_CIFAR = """
import importlib.abc, importlib.util, sys

class AcceptOurCifar(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision.datasets.cifar":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.check_integrity = lambda *args, **kwargs: True
            module.CIFAR10._check_integrity = lambda self: True

        spec.loader.exec_module = exec_module
        return spec

sys.meta_path.insert(0, AcceptOurCifar())
"""


def write_cifar10(root, *, per_batch: int = 128, test: int = 128) -> None:
    """A CIFAR-10 in its own format (cifar-10-batches-py: five training batches, a test batch, the class names), of
    32x32 RGB images whose class sets their colour, so that a few steps learn something."""
    import pickle

    import numpy as np

    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)

    def batch(n: int) -> dict:
        labels = rng.integers(0, 10, n)
        colours = np.stack([(labels * k) % 256 for k in (25, 70, 130)], axis=1).astype(np.float64)
        images = colours[:, :, None] + rng.normal(0, 30, (n, 3, 1024))
        return {"data": images.clip(0, 255).astype(np.uint8).reshape(n, 3072), "labels": labels.tolist()}

    for name, n in [*((f"data_batch_{i}", per_batch) for i in range(1, 6)), ("test_batch", test)]:
        (folder / name).write_bytes(pickle.dumps(batch(n)))
    (folder / "batches.meta").write_bytes(pickle.dumps({"label_names": [f"class{i}" for i in range(10)]}))


def test_an_rgb_data_set_trains_through_the_pipeline(tmp_path):
    """--dataset cifar10 from files on disk (3 x 32 x 32 images) through run_pippy.sh on 2 processes: the first
    stage's convolution takes 3 channels, the stages' shapes follow from the images, and the run learns."""
    from common.model import build_model

    write_cifar10(tmp_path / "data")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ACCEPT_OUR_CIFAR)
    out, env = tmp_path / "run", env_for_tests()
    env.update(NPROC="2", PYTHONPATH=f"{tmp_path / 'site'}:{env['PYTHONPATH']}")
    flags = ["--dataset", "cifar10", "--data-dir", str(tmp_path / "data"), "--batch-size", "32", "--epochs", "2"]
    run_command(["bash", "run_pippy.sh", *flags, "--dropout", "0", "--out", str(out)], env=env)
    run = read_run(out)
    rgb = build_model(seed=0, in_channels=3, image_size=32, num_classes=10, dropout=0.0)
    assert run["config"]["dataset"] == "cifar10" and run["model"]["parameters"] == sum(
        p.numel() for p in rgb.parameters()
    )
    train, evals = read_metrics(out)
    assert sorted(train) == list(range(1, 41)) and train[40]["loss"] < 0.5 * train[1]["loss"]
    assert evals[-1]["test_accuracy"] >= 0.5


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
    (8, ["--dp", "2", "--tp", "3"], "--dp", "2 x --tp 3 = 6 does not divide the world size 8"),  # dp x tp x pp
    (8, ["--model", "vit", "--tp", "8"], "--tp", "8 TP ranks do not split 4 heads"),
    (8, ["--dp", "2", "--tp", "2"], "--tp", "BabyCNN"),  # the pipeline's TP is the ViT's
    (4, ["--dp", "4", "--batch-size", "130"], "--batch-size", "does not split"),
    (4, ["--schedule", "pipedream"], "--schedule", "unknown"),
]


def _needs(flags: list[str]) -> tuple:
    """A case that names a V schedule or --tp: an older torch refuses the flag first (tests/floor)."""
    return (needs_torch(NEEDS_TP if "--tp" in flags else NEEDS_V),) if {"zbv", "dualpipev", "--tp"} & {*flags} else ()


@pytest.mark.parametrize(
    "world,flags,named,why", [pytest.param(*b, marks=_needs(b[1]), id=f"{b[2]}-{i}") for i, b in enumerate(BAD)]
)
def test_preflight_rejects_bad_combinations_in_one_line(world, flags, named, why):
    proc = run_command(
        [sys.executable, "-m", "runner.preflight", "pippy", "--world-size", str(world), *flags], check=False, timeout=60
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {named}:") and why in lines[0], lines[0]


@needs_torch(NEEDS_V)  # (the script's half names zbv)
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
