"""Seeing inside a step, on real processes (gloo): --profile-steps traces with named spans for every
strategy, the share of communication hidden behind compute, the pipeline timeline for every schedule,
--tensorboard scalars, and none of it when the flags are off. All trainings share the 2-process launch of
tests/integration/conftest.py."""

import json
import sys

import pytest

from common.config import SCHEDULES
from tests.helpers import SMALL, Run, read_run, run_command
from tools.timeline import main as timeline_main

STEPS = 3
SHORT = [*SMALL, "--max-steps", str(STEPS), "--batch-size", "32"]
PROFILED = [*SHORT, "--profile-steps", "2:3"]
STAGES_PER_RANK = {"gpipe": 1, "1f1b": 1}  # the others run 2


def trace_names(path) -> set[str]:
    events = json.loads(path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("ph") == "X"}


# Trainings in the shared launches (tests/integration/conftest.py), on 2 processes
POOLED = {
    "ddp": Run("ddp", [*PROFILED, "--tensorboard"], nproc=2),
    "fsdp": Run("fsdp", PROFILED, nproc=2),
    "ddp_plain": Run("ddp", SHORT, nproc=2),
    **{
        f"pp_{s}": Run(
            "pippy", [*PROFILED, "--schedule", s, "--stages-per-rank", str(STAGES_PER_RANK.get(s, 2))], nproc=2
        )
        for s in SCHEDULES
    },
}


@pytest.fixture(scope="module")
def runs(pool):
    return pool / "observability"


def test_traces_hold_the_named_spans_for_every_strategy(runs, untrained):
    step_parts = {"step 2", "step 3", "data", "optimizer"}
    expected = {
        "ddp": step_parts | {"forward", "backward", "gloo:all_reduce"},
        # FSDP2 names its own parts; on gloo the collectives themselves run as gloo:* ops
        "fsdp": step_parts
        | {"forward", "backward", "FSDP::all_gather", "FSDP::post_backward_reduce", "gloo:all_gather"},
        "pp_1f1b": step_parts | {"forward stage 0 mb 0", "backward stage 0 mb 3", "gloo:send", "gloo:recv"},
        "pp_zbv": step_parts | {"forward stage 3 mb 0", "backward_input stage 0 mb 1", "backward_weight stage 0 mb 1"},
    }
    for name, spans in ((n, s) for n, s in expected.items() if n not in untrained):
        per_rank = [trace_names(runs / name / "traces" / f"rank{rank}.json") for rank in (0, 1)]
        # each rank's stages' actions are in its own trace (zbv on 2 ranks: stages 0 and 3 on rank 0)
        assert spans <= per_rank[0] | per_rank[1], f"{name}: missing {sorted(spans - per_rank[0] - per_rank[1])}"
        for rank, names in enumerate(per_rank):
            assert step_parts <= names, f"{name} rank {rank}: missing {sorted(step_parts - names)}"
            assert any(n.startswith("forward") for n in names) and any(n.startswith("backward") for n in names)
            assert "step 1" not in names, "step 1 is outside --profile-steps 2:3"


def test_comm_hidden_fraction_is_a_share(runs):
    for name in ("ddp", "fsdp", "pp_1f1b"):
        profile = read_run(runs / name)["profile"]
        assert profile["steps"] == [2, 3]
        assert len(profile["per_rank"]) == 2
        assert profile["comm_s"] > 0, name
        assert 0.0 <= profile["comm_hidden_fraction"] <= 1.0, (name, profile)
        for rank in profile["per_rank"]:
            assert 0.0 <= rank["hidden_s"] <= rank["comm_s"] + 1e-9


def test_the_timeline_renders_for_every_schedule(runs, tmp_path, untrained):
    for schedule in (s for s in SCHEDULES if f"pp_{s}" not in untrained):
        run = runs / f"pp_{schedule}"
        timeline = json.loads((run / "timeline.json").read_text())
        assert timeline["schedule"] == schedule and timeline["step"] == STEPS
        stages = 2 * STAGES_PER_RANK.get(schedule, 2)
        # every stage ran a forward and a backward (or its input part) of every micro-batch
        actions = [a for rank in timeline["actions"] for a in rank]
        for kinds in ({"F"}, {"B", "I"}):
            done = {(a["stage"], a["mb"]) for a in actions if a["kind"] in kinds}
            assert done == {(s, m) for s in range(stages) for m in range(4)}, (schedule, kinds)
        assert len(timeline["window_s"]) == len(timeline["actions"]) == 2  # both pipeline ranks reported
        for start, end in timeline["window_s"]:
            assert 0 <= start < end
        out = tmp_path / f"{schedule}.png"
        if schedule == SCHEDULES[0]:  # the command, as the docs show it
            run_command([sys.executable, "-m", "tools.timeline", str(run), "--out", str(out)], timeout=60)
        else:  # the same main() in this process: a Python and matplotlib start-up fewer each
            assert timeline_main([str(run), "--out", str(out)]) == 0
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tensorboard_holds_a_loss_point_per_step(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs / "ddp" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, STEPS + 1))
    train = [json.loads(line) for line in (runs / "ddp" / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in train if r["kind"] == "train"}
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx([losses[s] for s in sorted(losses)])
    assert {"train/lr", "train/samples_per_s", "eval/test_loss", "eval/test_accuracy"} <= set(events.Tags()["scalars"])


def test_nothing_of_it_without_the_flags(runs):
    plain = runs / "ddp_plain"
    assert not (plain / "traces").exists() and not (plain / "tensorboard").exists()
    assert "profile" not in read_run(plain) or read_run(plain)["profile"] is None


def test_memory_snapshot_on_cpu_is_one_line():
    # refused by the runner's preflight, before torchrun starts
    proc = run_command(["bash", "run_ddp.sh", "--memory-snapshot", "--profile-steps", "1:2"], check=False, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: --memory-snapshot: needs CUDA (it records the CUDA allocator); this run is on CPU: drop the flag"
    ]
