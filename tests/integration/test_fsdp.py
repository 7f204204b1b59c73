"""FSDP on real processes (gloo): every sharding mode against one process, a worker killed during a save and
the resume after it, resharding of DCP checkpoints, memory against DDP and against the theory, bf16, the
exported model.pt, the runner."""

import shutil

import pytest
import torch

from common.checkpoint import latest_checkpoint, verify_checkpoint
from common.cli import build_parser
from tests.helpers import (
    PARITY,
    PARITY_STEPS,
    SGD,
    SMALL,
    Run,
    env_for_tests,
    kill_a_worker_when,
    launch,
    losses,
    max_abs_diff,
    read_metrics,
    read_run,
    run_command,
    start_runner,
)

MODES = ("full", "grad-op", "hybrid", "none")
SHARDS_ON_4 = {"full": 4, "grad-op": 4, "hybrid": 2, "none": 1}  # ranks one parameter is split over
# The SGD runs also carry one option each that must not change the numbers: activation checkpointing
# (recompute), CPU offload (the optimizer steps on CPU copies), accumulation (HSDP skips the reduce-scatter
# and the all-reduce on the inner micro-step) with one FSDP unit per block.
SGD_EXTRA = {
    "full": ["--activation-checkpointing"],
    "grad-op": ["--cpu-offload"],
    "hybrid": ["--grad-accum-steps", "2", "--shard-units", "blocks"],
    "none": [],
}
# 30 AdamW steps with a checkpoint every 15: parity over 30 steps, and the step-15 checkpoint to resume from
LONG = [*PARITY, "--checkpoint-every", "15"]
# the other runs compare only their losses: the 20 steps the parity asks for
TWENTY = ["--max-steps", "20"]


# Trainings in the shared launches (tests/integration/conftest.py): every sharding mode on 4 ranks, and the
# 4-rank step-15 checkpoint of "adamw_full" resumed on 2 ranks (in a copy of that run as it stood then)
POOLED = {
    "ddp4": Run("ddp", [*PARITY, "--max-steps", "2"]),  # only for its memory record
    "bf16": Run("fsdp", [*SMALL, "--batch-size", "96", "--precision", "bf16", "--sharding", "grad-op"]),
    "adamw_blocks": Run("fsdp", [*PARITY, *TWENTY, "--shard-units", "blocks"]),
    **{
        f"{optimizer}_{mode}": Run("fsdp", flags)
        for mode in MODES
        for optimizer, flags in (
            ("adamw", [*LONG, "--sharding", mode, *([] if mode == "full" else TWENTY)]),
            ("sgd", [*PARITY, *TWENTY, *SGD, "--sharding", mode, *SGD_EXTRA[mode]]),
        )
    },
    "on2": Run("fsdp", [*LONG, "--resume"], nproc=2, rewound_from=("fsdp/adamw_full", 15)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, pool, references):
    """The pooled runs, the 1-process references (shared with test_ddp.py), and the 4-rank step-15 checkpoint
    resumed by one process in a folder that holds only that checkpoint."""
    out = {**references, **{name: pool / "fsdp" / name for name in POOLED}}
    out["on1"] = tmp_path_factory.mktemp("fsdp") / "on1"
    step15 = "checkpoints/step_0000015"
    shutil.copytree(out["adamw_full"] / step15, out["on1"] / step15)
    launch("train_fsdp.py", 1, [*LONG, "--resume"], out["on1"])
    return out


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """run_fsdp.sh on 4 ranks, a checkpoint every 5 steps, one worker SIGKILLed in the middle of the
    first save after step 15 (MAX_RESTARTS=0: the job ends); what it left on disk; then the same command with
    --resume."""
    out = tmp_path_factory.mktemp("killed") / "run"
    flags = [*PARITY, "--checkpoint-every", "5"]
    runner = start_runner("fsdp", flags, out, NPROC="4")

    def saving_after_step_15() -> bool:
        return any(int(p.name[len("step_") : -len(".tmp")]) > 15 for p in (out / "checkpoints").glob("step_*.tmp"))

    rank, output = kill_a_worker_when(runner, out, 4, saving_after_step_15, poll_s=0.002)  # a save takes ~0.1 s
    left = {
        "returncode": runner.returncode,
        "killed_rank": rank,
        "output": output,
        "unfinished": sorted(p.name for p in (out / "checkpoints").glob("*.tmp")),
        "latest": latest_checkpoint(str(out)),
    }
    resumed = run_command(
        ["bash", "run_fsdp.sh", *flags, "--resume", "--out", str(out)], env={**env_for_tests(), "NPROC": "4"}
    )
    return out, left, resumed.stdout


@pytest.mark.parametrize("mode", MODES)
def test_every_sharding_mode_matches_one_process_adamw(runs, mode):
    ref = losses(runs["adamw"])
    assert len(ref) == PARITY_STEPS and ref[-1] < ref[0] * 0.7, "the reference run should learn"
    run_losses = losses(runs[f"adamw_{mode}"])
    assert len(run_losses) == (PARITY_STEPS if mode == "full" else 20)
    assert max_abs_diff(run_losses, ref[: len(run_losses)]) <= 1e-4
    run = read_run(runs[f"adamw_{mode}"])
    assert (run["strategy"], run["world_size"], run["config"]["sharding"]) == ("fsdp", 4, mode)
    assert run["mesh"]["shard"] == SHARDS_ON_4[mode] and run["mesh"].get("replicate", 1) == 4 // SHARDS_ON_4[mode]


def test_one_unit_per_block_matches_one_process(runs):
    # --shard-units blocks: features and classifier each gathered on their own, the classifier kept from
    # forward to backward; the same numbers as one process
    run_losses = losses(runs["adamw_blocks"])
    assert len(run_losses) == 20 and max_abs_diff(run_losses, losses(runs["adamw"])[:20]) <= 1e-4
    assert read_run(runs["adamw_blocks"])["config"]["shard_units"] == "blocks"
    assert read_run(runs["adamw_full"])["config"]["shard_units"] == "model"


@pytest.mark.parametrize("mode", MODES)
def test_every_sharding_mode_matches_one_process_sgd(runs, mode):
    ref = losses(runs["sgd"])
    # the tolerance means something only where the reference itself is stable at that tolerance
    assert max_abs_diff(losses(runs["sgd_1thread"]), ref) <= 1e-4, "the reference itself must be stable"
    run_losses = losses(runs[f"sgd_{mode}"])
    assert len(run_losses) == 20 and max_abs_diff(run_losses, ref[:20]) <= 1e-4
    assert ref[-1] < ref[0]


def test_a_worker_killed_during_a_save_ends_the_job_naming_it(killed):
    _, left, _ = killed
    # torchrun stops the other workers; the runner names the one killed, in one line instead of torchrun's table
    assert left["returncode"] == 137
    (line,) = [line for line in left["output"].splitlines() if "error" in line or "Error" in line]
    assert line.startswith(f"error: rank {left['killed_rank']} was killed by SIGKILL at step ")
    assert "out-of-memory killer" in line and "continue with: NPROC=4 bash run_fsdp.sh" in line
    assert "Root Cause" not in left["output"] and "Traceback" not in left["output"]


def test_a_kill_during_a_save_leaves_a_loadable_latest(killed):
    out, left, _ = killed
    # the interrupted save (after step 20, or 25 if the first was missed) is still a .tmp folder, never
    # loaded; the latest is the one before it, and it is sound
    (unfinished,) = left["unfinished"]
    previous = f"step_{int(unfinished[len('step_') : -len('.tmp')]) - 5:07d}"
    assert unfinished in ("step_0000020.tmp", "step_0000025.tmp")
    assert left["latest"] == str(out / "checkpoints" / previous) and verify_checkpoint(left["latest"]) is None


def test_resume_on_the_same_world_size_continues_bit_identically(runs, killed):
    out, left, stdout = killed
    assert f"resumed from {left['latest']} (step " in stdout
    # killed during a save, resumed in a new launch: the remaining steps bit for bit (1e-6 asked for)
    assert losses(out) == losses(runs["adamw_full"])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [f"step_{s:07d}" for s in (5, 10, 15, 20, 25, 30)]


@pytest.mark.parametrize("world_size", (2, 1))
def test_a_four_rank_checkpoint_resumes_on_fewer_ranks(runs, world_size):
    # DCP reshards at load time: model *and* optimizer state (restarting AdamW's moments at step 15 moves
    # the later losses by ~5e-2, so 1e-4 would catch a lost optimizer state)
    out = runs[f"on{world_size}"]
    train, _ = read_metrics(out)
    # on 2 ranks the run folder as it stood after step 15; on 1 a folder with only the checkpoint, where the
    # resumed run writes the steps after it
    assert sorted(train) == list(range(1 if world_size == 2 else 16, 31))
    full = losses(runs["adamw_full"])
    assert max(abs(train[s]["loss"] - full[s - 1]) for s in range(16, 31)) <= 1e-4
    assert read_run(out)["world_size"] == world_size


def test_full_sharding_holds_at_most_0_3_of_ddps_memory(runs):
    def totals(name):
        per_rank = read_run(runs[name])["memory"]["per_rank"]
        return [m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in per_rank]

    ddp, full = totals("ddp4"), totals("adamw_full")
    assert len(ddp) == len(full) == 4
    assert max(full) <= 0.3 * min(ddp), (full, ddp)
    assert totals("adamw_none") == ddp, "none (NO_SHARD) keeps a full replica on every rank, as DDP does"


@pytest.mark.parametrize("mode", MODES)
def test_measured_memory_agrees_with_the_theory(runs, mode):
    memory = read_run(runs[f"adamw_{mode}"])["memory"]
    theory = memory["theory"]
    assert theory["shards"] == SHARDS_ON_4[mode] and theory["parameters"] == 1_273_610
    assert theory["param_bytes"] + theory["grad_bytes"] + theory["optim_bytes"] == 16 * 1_273_610 / theory["shards"]
    for rank in memory["per_rank"]:
        for kind in ("param_bytes", "grad_bytes", "optim_bytes"):
            # the theory divides evenly; fc2's 10 rows split over 4 ranks as 3, 3, 3, 1 (and AdamW's step
            # counters add 4 bytes per tensor), so a rank may differ by well under 1%
            assert rank[kind] == pytest.approx(theory[kind], rel=0.01), (rank, theory)
    # the shards of one replica add up to every parameter exactly once
    replica = memory["per_rank"][: theory["shards"]]
    assert sum(r["param_bytes"] for r in replica) == 4 * theory["parameters"]


def test_bf16_runs_and_learns(runs):
    train, evals = read_metrics(runs["bf16"])
    loss = [train[s]["loss"] for s in sorted(train)]
    assert len(loss) == 32 and loss[-1] < 0.5 * loss[0]
    assert evals[-1]["test_accuracy"] >= 0.8
    run = read_run(runs["bf16"])
    # mixed precision computes in bf16, but the sharded parameters the optimizer updates stay fp32
    memory = run["memory"]
    assert memory["per_rank"][0]["param_bytes"] == pytest.approx(memory["theory"]["param_bytes"], rel=0.01)


def test_model_pt_is_the_trained_model_for_a_plain_babycnn(runs):
    from common.config import Config
    from common.data import load_dataset, to_device_batch
    from common.model import BabyCNN

    out = runs["adamw_full"]
    model = BabyCNN()
    model.load_state_dict(torch.load(out / "model.pt", weights_only=True))  # strict: every key, right shapes
    data = load_dataset(Config(train_size=1536, test_size=256))
    images, labels = to_device_batch(data.test, torch.arange(len(data.test)), data, torch.device("cpu"))
    with torch.no_grad():
        hits = (model.eval()(images).argmax(dim=1) == labels).sum().item()
    # the trained weights, not the initial ones: the same predictions as the run's own evaluation
    assert abs(hits - 256 * read_run(out)["final"]["test_accuracy"]) <= 1
    # activation checkpointing wraps the model, but the wrapper's name stays out of the keys
    BabyCNN().load_state_dict(torch.load(runs["sgd_full"] / "model.pt", weights_only=True))


def test_runner_resumes_and_writes_the_metrics_contract(killed):
    out, _, _ = killed
    train, evals = read_metrics(out)  # fails on a step logged twice
    assert sorted(train) == list(range(1, PARITY_STEPS + 1)) and [e["step"] for e in evals] == [PARITY_STEPS]
    for record in train.values():
        assert set(record) == {"kind", "step", "loss", "lr", "grad_norm", "samples_per_s", "step_time_s"}
    run = read_run(out)
    assert (run["strategy"], run["world_size"], run["backend"]) == ("fsdp", 4, "gloo")
    assert run["config"]["sharding"] == "full" and "schedule" not in run["config"]
    assert [m["rank"] for m in run["memory"]["per_rank"]] == [0, 1, 2, 3]
    assert run["final"]["test_accuracy"] == evals[-1]["test_accuracy"] and (out / "model.pt").exists()


@pytest.mark.parametrize(
    "flags,env,named",
    [
        (["--sharding", "zero3"], {}, "--sharding"),
        (["--shard-units", "layers"], {}, "--shard-units"),
        (["--sharding", "hybrid", "--batch-size", "96"], {"NPROC": "3"}, "--sharding"),  # hybrid needs an even world
    ],
)
def test_runner_rejects_bad_input_with_one_line(flags, env, named, tmp_path):
    proc = run_command(
        ["bash", "run_fsdp.sh", *flags, "--out", str(tmp_path / "out")],
        env={**env_for_tests(), **env},
        check=False,
        timeout=60,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:") and named in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_help_lists_the_fsdp_flags():
    # the parser train_fsdp.py builds (tests/test_ddp.py runs a script's --help for real)
    text = build_parser("fsdp").format_help()
    assert "--sharding" in text and "--activation-checkpointing" in text and "--schedule" not in text
