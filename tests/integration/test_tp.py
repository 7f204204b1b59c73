"""Tensor parallelism on real processes (gloo): TP and FSDP x TP follow one process, their checkpoints resume
exactly, reshard to another TP degree and cross to and from DDP and FSDP; what each rank holds (run.json) and
the collectives TP adds (the profile); bad input refused before torchrun. Clipped parity, on 2 and 4 ranks:
test_essentials.py; at a larger size: test_scale.py; a resume at a chaotic learning rate: test_resume.py."""

import pytest

from common.model import build_model
from common.versions import NEEDS_TP
from planner.predict import tp_state_bytes_theory
from tests.helpers import (
    PP_PARITY,
    Run,
    assert_follows,
    assert_resumed,
    env_for_tests,
    losses,
    max_abs_diff,
    needs_torch,
    observed,
    printed,
    read_metrics,
    read_run,
    run_command,
)

pytestmark = needs_torch(NEEDS_TP)  # every test here trains or checks TP

# The 1-process reference "pipeline" (tests/integration/conftest.py) runs these flags, with a checkpoint after
# step 12 for TP to resume; TP's own runs checkpoint there too.
AT_12 = [*PP_PARITY, "--checkpoint-every", "12"]
RESUME = [*AT_12, "--resume"]
FSDP_X_TP = ["--dp", "2"]
# |Δloss| and relative |Δgrad_norm| against one process: ~10x the 3.6e-7 and 1.9e-7 measured here
FOLLOWS = {"loss": 3e-6, "grad_norm": 2e-6}

# Trainings in the shared launches (tests/integration/conftest.py)
POOLED = {
    "tp": Run("tp", [*AT_12, "--profile-steps", "2:3"]),  # 4-way TP
    "fsdp-x-tp": Run("tp", [*AT_12, *FSDP_X_TP]),  # 2 replicas x 2-way TP
    "fsdp-x-tp-resumed": Run("tp", [*RESUME, *FSDP_X_TP], rewound_from=("tp/fsdp-x-tp", 12)),
    # FSDP's sync on the last micro-step; the reference's first 10 steps (its evaluation after step 10 included)
    "fsdp-x-tp-accum": Run("tp", [*PP_PARITY, *FSDP_X_TP, "--grad-accum-steps", "2", "--max-steps", "10"]),
    "tp-from-ddp": Run("tp", RESUME, rewound_from=("references/pipeline", 12)),  # DDP's 1-process checkpoint
    "fsdp-from-tp": Run("fsdp", RESUME, rewound_from=("tp/tp", 12)),
    "fsdp-x-tp-from-tp": Run("tp", [*RESUME, *FSDP_X_TP], rewound_from=("tp/tp", 12)),  # onto the 2-D mesh
    "tp2-from-tp4": Run("tp", RESUME, nproc=2, rewound_from=("tp/tp", 12)),  # 4-way TP's shards, 2-way
    "bf16": Run("tp", [*PP_PARITY, "--precision", "bf16"], nproc=2, observe=True),
}
CROSSINGS = {  # name: the run whose step-12 checkpoint it resumed
    "tp-from-ddp": "references/pipeline",
    "fsdp-from-tp": "tp/tp",
    "fsdp-x-tp-from-tp": "tp/tp",
    "tp2-from-tp4": "tp/tp",
}


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "tp"


@pytest.fixture(scope="module")
def reference(references):
    return references["pipeline"]


@pytest.mark.parametrize("name", ["tp", "fsdp-x-tp", "fsdp-x-tp-accum"])
def test_tp_follows_one_process(runs, reference, name):
    steps = len(losses(runs / name))
    assert steps == (10 if name == "fsdp-x-tp-accum" else 20)
    assert_follows(runs / name, reference, **FOLLOWS)
    # the test set is split over the replicas only (a replica's TP ranks evaluate the same images): the same count
    (at_end,) = [e for e in read_metrics(reference)[1] if e["step"] == steps]
    assert read_metrics(runs / name)[1][-1]["test_accuracy"] == at_end["test_accuracy"]


def test_fsdp_x_tp_resumes_its_own_checkpoint_bit_for_bit(runs):
    again = runs / "fsdp-x-tp-resumed"
    assert_resumed(again, 12, printed(again), source=runs / "fsdp-x-tp")
    full, resumed = read_metrics(runs / "fsdp-x-tp"), read_metrics(again)
    timing = ("samples_per_s", "step_time_s")
    strip = lambda records: [{k: v for k, v in r.items() if k not in timing} for r in records]  # noqa: E731
    assert strip(full[0].values()) == strip(resumed[0].values()) and len(full[0]) == 20
    assert full[1] == resumed[1]  # the evaluations too


@pytest.mark.parametrize("name", CROSSINGS)
def test_checkpoints_cross_strategies_and_tp_degrees_on_the_same_curve(pool, runs, reference, name):
    # resumed after step 12 of another strategy or TP degree, the run goes on along the 1-process curve
    assert_resumed(runs / name, 12, printed(runs / name), source=pool / CROSSINGS[name])
    assert_follows(runs / name, reference, **FOLLOWS, steps=range(13, 21))
    assert read_run(runs / name)["strategy"] == ("fsdp" if name == "fsdp-from-tp" else "tp")


def split_parameter_count() -> int:
    """What TP splits of BabyCNN: fc1 (column-wise: weight and bias) and fc2's weight (row-wise)."""
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.0)
    return model.fc1.weight.numel() + model.fc1.bias.numel() + model.fc2.weight.numel()


@pytest.mark.parametrize("name, tp, dp", [("tp", 4, 1), ("fsdp-x-tp", 2, 2)])
def test_each_rank_holds_its_slice_of_the_split_layers(runs, name, tp, dp):
    run = read_run(runs / name)
    ddp_bytes = 4 * split_parameter_count()  # what DDP holds of them on every rank
    assert run["mesh"] == {"dp": dp, "tp": tp} and run["tp"]["split_layers"] == ["fc1", "fc2"]
    theory = tp_state_bytes_theory("baby", tp=tp, dp=dp, optimizer="adamw")  # (planner/predict.py)
    assert theory["split_param_bytes"] == ddp_bytes / tp / dp
    assert len(run["memory"]["per_rank"]) == run["world_size"] == tp * dp  # every rank reported
    for rank in run["memory"]["per_rank"]:
        assert rank["param_bytes_of"]["split"] == ddp_bytes / tp / dp  # 1/tp of DDP's (and FSDP's 1/dp of that)
        assert rank["param_bytes"] == theory["param_bytes"] == rank["grad_bytes"]


def test_the_profile_names_the_collectives_tp_adds(runs):
    # 2 profiled steps: per step one all-reduce in forward (fc2, row-wise: its partial outputs) and one in
    # backward (fc1, column-wise: the gradient of its input); outside both, the loss's and the norm's, and the
    # preemption check after a step (stop_requested: the first profiled step's falls inside the window)
    profiled = read_run(runs / "tp")["profile"]["per_rank"]
    assert len(profiled) == 4  # every rank of the 4-way TP run
    for rank in profiled:
        collectives = rank["collectives"]
        assert collectives["forward"] == {"gloo:all_reduce": 2} and collectives["backward"] == {"gloo:all_reduce": 2}
        assert collectives["other"] == {"gloo:all_reduce": 5}


def test_bf16_computes_in_bf16_and_follows_fp32_closely(runs, reference):
    # autocast: the split matmuls in bf16, their partial sums added in bf16; the master weights stay fp32
    probes = observed(runs / "bf16")
    assert len(probes) == 2  # both ranks
    for rank in probes:  # what the layers returned in training, on every rank
        assert rank["dtypes"] == dict.fromkeys(("Conv2d", "LayerNorm", "Linear"), ["torch.bfloat16"])
    # measured: 1.7e-4 apart at step 1, 5.4e-3 at most over the 20 steps; fp32 arithmetic would be ~1e-6 apart
    bf16, fp32 = losses(runs / "bf16"), losses(reference)
    assert abs(bf16[0] - fp32[0]) <= 2e-3 and 5e-4 <= max_abs_diff(bf16, fp32) <= 5e-2
    memory = read_run(runs / "bf16")["memory"]
    theory = tp_state_bytes_theory("baby", tp=2, dp=1, optimizer="adamw")
    assert len(memory["per_rank"]) == 2
    assert all(rank["param_bytes"] == theory["param_bytes"] for rank in memory["per_rank"])  # fp32


@pytest.mark.parametrize(
    "env, flags, named",
    [
        ({"NPROC": "3"}, [], "--model-size baby: its classifier's width 128 does not split over 3 TP ranks"),
        ({"NPROC": "4"}, ["--dp", "3"], "--dp: 3 does not divide the world size 4"),
        ({"NPROC": "4"}, ["--dp", "2", "--batch-size", "63"], "does not split evenly over 2 data-parallel replicas"),
        ({"NPROC": "4"}, ["--sequence-parallel"], "--sequence-parallel: a flag of the ViT (--model vit)"),
        (
            {"NPROC": "4"},
            ["--model", "vit", "--sequence-parallel", "--patch-size", "4"],
            "--sequence-parallel: the 49 tokens of 28 x 28 images in 4 x 4 patches do not split over 4 TP ranks",
        ),
    ],
)
def test_bad_input_is_one_line_before_torchrun(tmp_path, env, flags, named):
    out = tmp_path / "out"
    proc = run_command(["bash", "run_tp.sh", *flags, "--out", str(out)], env={**env_for_tests(), **env}, check=False)
    assert proc.returncode == 2 and proc.stdout == "" and not out.exists()
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and named in line
