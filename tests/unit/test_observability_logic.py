"""The logic behind --profile-steps and the timeline on hand-made data, without processes: interval
unions and overlaps, the hidden-communication share from synthetic trace events, the flags' validation,
a recorder without --profile-steps that loads no profiler, and the timeline drawn for single-stage and V
layouts."""

import pytest

from common.config import Config
from common.errors import ConfigError
from common.profiling import collectives_by_span, comm_overlap, overlap_s, union
from tools.timeline import draw, title


def op(name, ts, dur, tid=1, cat="cpu_op"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid, "cat": cat}


def test_union_and_overlap():
    assert union([(3, 4), (0, 1), (0.5, 2)]) == [(0, 2), (3, 4)]
    assert overlap_s([(0, 2), (3, 4)], [(1, 3.5)]) == pytest.approx(1.5)
    assert overlap_s([(0, 1)], [(1, 2)]) == 0
    # overlapping pieces on one side are counted once
    assert overlap_s([(0, 10)], [(1, 3), (2, 4)]) == pytest.approx(3)


def test_comm_overlap_counts_compute_on_other_threads_only():
    events = [
        op("gloo:all_reduce", 100, 100, tid=9, cat="user_annotation"),  # comm thread: 100..200 µs
        op("aten::mm", 150, 100),  # compute, overlaps 50 µs
        op("c10d::allreduce_", 0, 300),  # the enqueueing call: neither comm nor compute
        op("ProfilerStep#1", 0, 300),
        op("aten::add", 120, 10, tid=9),  # on the comm thread: not compute
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    result = comm_overlap(events)
    assert result["comm_s"] == pytest.approx(100e-6)
    assert result["hidden_s"] == pytest.approx(50e-6)
    assert comm_overlap([op("aten::mm", 0, 10)]) == {"comm_s": 0.0, "hidden_s": 0.0}


def test_collectives_are_counted_in_the_innermost_span_they_begin_in():
    events = [
        op("forward", 0, 100, cat="user_annotation"),
        op("step 2", 0, 300, cat="user_annotation"),  # not a named span of the recorder
        op("gloo:all_reduce", 50, 10, tid=9),  # inside forward
        op("backward", 100, 100, cat="user_annotation"),
        op("gloo:all_reduce", 150, 80, tid=9),  # begins in backward, ends after it
        op("gloo:all_gather", 160, 5, tid=9),
        op("gloo:all_reduce", 250, 5, tid=9),  # after both
        op("aten::mm", 20, 10),
    ]
    assert collectives_by_span(events, {"forward", "backward"}) == {
        "forward": {"gloo:all_reduce": 1},
        "backward": {"gloo:all_reduce": 1, "gloo:all_gather": 1},
        "other": {"gloo:all_reduce": 1},
    }


@pytest.mark.parametrize("spec", ["3", "0:2", "5:3", "a:b", "3:", ":3"])
def test_bad_profile_steps_are_config_errors(spec):
    with pytest.raises(ConfigError, match="--profile-steps"):
        Config(profile_steps=spec).check()


def test_memory_snapshot_needs_cuda_and_steps():
    with pytest.raises(ConfigError, match="needs CUDA"):
        Config(memory_snapshot=True, profile_steps="1:2", device="cpu").check()
    with pytest.raises(ConfigError, match="add --profile-steps"):
        Config(memory_snapshot=True, device="cuda").check()
    Config(profile_steps="3:5").check()
    # a worker knows its device: --device auto on a machine whose GPUs it could not use runs on the CPU
    Config(memory_snapshot=True, profile_steps="1:2", device="cuda").check(device_type="cuda")
    with pytest.raises(ConfigError, match="needs CUDA"):
        Config(memory_snapshot=True, profile_steps="1:2", device="cuda").check(device_type="cpu")


def test_without_profile_steps_the_recorder_profiles_nothing(tmp_path):
    import torch

    from common.distributed import DistEnv
    from common.recorder import RunRecorder
    from common.training import NoLossScaling

    env = DistEnv(rank=1, local_rank=1, world_size=2, local_world_size=2, device=torch.device("cpu"), backend="gloo")
    recorder = RunRecorder(Config(out=str(tmp_path)), env, start_step=0, total_steps=3, parameters=1, logs=False)
    for step in recorder.steps():
        with recorder.span("forward"):
            pass
        recorder.train(step, loss=1.0, lr=0.1, grad_norm=1.0, scaler=NoLossScaling())
    assert recorder.profiler is None and recorder.span("a") is recorder.span("b")  # one shared no-op context
    assert list(tmp_path.iterdir()) == []  # a rank that does not log writes nothing
    with pytest.raises(FloatingPointError, match="at step 4"):
        recorder.train(4, loss=float("nan"), lr=0.1, grad_norm=1.0, scaler=NoLossScaling())


def timeline(layout, schedule):
    """A made-up timeline: rank r runs F then B of each micro-batch of each of its stages in turn."""
    actions, windows = [], []
    for rank, stages in enumerate(layout):
        t, acts = 0.001 * rank, []
        for stage in stages:
            for kind in ("F", "I", "W") if schedule == "zbv" else ("F", "B"):
                for mb in range(2):
                    acts.append({"stage": stage, "kind": kind, "mb": mb, "start": t, "end": t + 0.002})
                    t += 0.003  # 1 ms idle after each action
        actions.append(acts)
        windows.append([0.0, t])
    n_stages = sum(len(s) for s in layout)
    return {
        "step": 5,
        "pp_size": len(layout),
        "schedule": schedule,
        "n_microbatches": 2,
        "stage_layers": [[f"layer{s}a", f"layer{s}b"] for s in range(n_stages)],
        "bubble": {"measured": 0.4, "theory": 0.2},
        "window_s": windows,
        "actions": actions,
    }


@pytest.mark.parametrize(
    "layout,schedule", [([[0], [1]], "1f1b"), ([[0, 2], [1, 3]], "interleaved-1f1b"), ([[0, 3], [1, 2]], "zbv")]
)
def test_the_timeline_draws_every_layout(tmp_path, layout, schedule):
    data = timeline(layout, schedule)
    out = tmp_path / "t.png"
    draw(data, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "bubble measured 40%, theory 20%" in title(data)


def test_tensorboard_missing_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        Config(tensorboard=True).check()
