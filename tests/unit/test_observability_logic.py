"""The logic behind --profile-steps and the timeline on hand-made data, without processes: interval
unions and overlaps, the hidden-communication share from synthetic trace events, the flags' validation,
the off-by-default StepProfiler, and the timeline drawn for single-stage and V layouts."""

import pytest

from common.config import Config, ConfigError
from common.profiling import StepProfiler, comm_overlap, overlap_s, union
from common.timeline import draw, idle_fraction, title


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


def test_the_profiler_is_nothing_when_off():
    import torch

    profiler = StepProfiler("", out_dir="/nonexistent", rank=0, device=torch.device("cpu"))
    for step in range(1, 4):
        profiler.step_start(step)
        with profiler.span("forward"):
            pass
        profiler.step_end(step)
    assert profiler._profiler is None and profiler.report() is None
    assert profiler.span("a") is profiler.span("b")  # one shared no-op context


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


def test_idle_fraction():
    data = timeline([[0], [1]], "gpipe")
    busy = 4 * 0.002
    window = sum(end - start for start, end in data["window_s"])
    assert idle_fraction({**data}) == pytest.approx(1 - 2 * busy / window)
    assert "bubble measured" in title({**data, "bubble": None})


def test_tensorboard_missing_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match="pip install tensorboard"):
        Config(tensorboard=True).check()
