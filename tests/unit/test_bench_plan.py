"""The benchmark's plan, arithmetic and trace reading without launching anything: every run it plans is a
configuration the scripts accept (a bad flag fails here in seconds, not minutes into a benchmark), profiling
never touches the timed steps, ratios are taken round by round, and the step breakdown is read correctly
from a hand-made trace."""

import pytest

from bench.breakdown import step_parts, summarize
from bench.plan import Settings, default_plan
from bench.report import annotate
from common.cli import parse_config
from common.versions import NEEDS_V
from tests.helpers import needs_torch

SETTINGS = Settings(batch_size=128, warmup=3, timed=30, test_size=256)


@needs_torch(NEEDS_V)  # the plan runs every schedule, TP too (2.12 both)
def test_every_planned_run_is_a_valid_configuration():
    # the full benchmark takes minutes: a flag combination the scripts reject must fail here, not in it
    plan = default_plan([1, 2, 4], modes_procs=4, full_runs=True, bf16=True, more_bf16=True)
    assert {"pipeline 1f1b, 2 replicas × 2 stages", "pipeline zbv", "fsdp hybrid"} <= {spec.name for spec in plan}
    for spec in plan:
        if spec.strategy != "baseline":  # every flag of the launch, as the script will parse it
            parse_config(spec.strategy, spec.flags(SETTINGS), world_size=spec.nproc)


def test_profiled_steps_come_after_the_timed_ones():
    # the step breakdown's runs: DDP on 1 process, and one rank's share of the 4-process step on one process
    plan = default_plan([1, 2, 4], modes_procs=2, full_runs=True, bf16=True)
    profiled = [spec for spec in plan if spec.profile_steps]
    assert [(s.strategy, s.nproc, s.global_batch(SETTINGS)) for s in profiled] == [("ddp", 1, 128), ("ddp", 1, 32)]
    for spec in profiled:
        cfg = parse_config(spec.strategy, spec.flags(SETTINGS), world_size=1)
        first, last = (int(step) for step in cfg.profile_steps.split(":"))
        assert first == SETTINGS.warmup + SETTINGS.timed + 1 and last == cfg.max_steps
        assert last - first + 1 == spec.profile_steps >= 2  # the first profiled step is left out
        assert cfg.eval_every == first - 1  # an evaluation before profiling: the peak RSS is read up to it


def test_ratios_are_taken_round_by_round():
    # each row holds its median launch and every launch in round order; a strategy's ratio to the baseline
    # (and bf16's to fp32) is also taken within each round, where the two ran minutes apart, not more
    def row(name, strategy, precision, each):
        return {
            "name": name,
            "strategy": strategy,
            "precision": precision,
            "nproc": 1,
            "launcher": "python",
            "samples_per_s": sorted(each)[len(each) // 2],
            "samples_per_s_of_each_launch": each,
        }

    rows = [
        row("baseline", "baseline", "fp32", [100.0, 200.0, 150.0]),
        row("ddp", "ddp", "fp32", [150.0, 180.0, 160.0]),
        row("ddp", "ddp", "bf16", [300.0, 270.0, 320.0]),
    ]
    annotate(rows, flops_per_sample=1e6, peaks={"fp32": 1.0, "bf16": 2.0})
    baseline, fp32, bf16 = rows
    assert fp32["vs_baseline"] == pytest.approx(160 / 150)
    assert fp32["vs_baseline_each_round"] == pytest.approx([1.5, 0.9, 160 / 150])
    assert "vs_baseline_each_round" not in baseline
    assert bf16["vs_fp32"] == pytest.approx(300 / 160)
    assert bf16["vs_fp32_each_round"] == pytest.approx([2.0, 1.5, 2.0])


def span(name, ts, dur, tid=1, cat="user_annotation"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def profiled_step(number, ts, *, data, forward, backward, optimizer, metrics, other):
    """A `step N` span and its parts, one after another, with `other` µs left between them."""
    parts, t = [], ts + other
    for name, dur in [("data", data), ("forward", forward), ("backward", backward), ("optimizer", optimizer)]:
        parts.append(span(name, t, dur))
        t += dur
    parts.append(span("metrics", t, metrics))
    total = other + data + forward + backward + optimizer + metrics
    return [span(f"step {number}", ts, total), *parts]


def test_step_breakdown_from_trace_spans():
    events = [
        # the first profiled step pays for the profiler's start-up: left out
        *profiled_step(3, 0, data=900, forward=900, backward=900, optimizer=900, metrics=900, other=900),
        *profiled_step(4, 10_000, data=50, forward=200, backward=300, optimizer=100, metrics=10, other=140),
        *profiled_step(5, 20_000, data=100, forward=400, backward=500, optimizer=100, metrics=20, other=80),
        span("gloo:all_reduce", 10_300, 100, tid=2),  # the communication thread: not a part of the step
        span("forward", 20_100, 50, tid=2),  # a span of the same name on another thread: not this step's
        span("forward", 20_100, 50, cat="cpu_op"),  # an operator, not one of the script's spans
        span("data", 30_000, 50),  # outside every step
    ]
    steps = step_parts(events)
    assert steps[4] == {
        "step": 800,
        "data": 50,
        "forward": 200,
        "backward": 300,
        "optimizer": 100,
        "metrics": 10,
        "other": 140,
    }
    breakdown = summarize(steps)
    assert breakdown["steps"] == [4, 5]
    assert breakdown["median_ms"]["step"] == pytest.approx((0.8 + 1.2) / 2)
    assert breakdown["median_ms"]["forward"] == pytest.approx((0.2 + 0.4) / 2)
    assert breakdown["median_ms"]["other"] == pytest.approx((0.14 + 0.08) / 2)
    # shares of the total step time over the kept steps (2000 µs)
    assert breakdown["share"] == pytest.approx(
        {"data": 0.075, "forward": 0.3, "backward": 0.4, "optimizer": 0.1, "metrics": 0.015, "other": 0.11}
    )
    assert sum(breakdown["share"].values()) == pytest.approx(1, abs=1e-12)
    with pytest.raises(ValueError, match="two profiled steps"):
        summarize({4: steps[4]})


def test_a_launch_reports_its_first_record_and_the_hypervisors_share(tmp_path):
    import sys

    from bench.launches import launch, stolen_seconds

    metrics = tmp_path / "metrics.jsonl"  # (a launch runs from the suite's root)
    write = f"import time; time.sleep(0.2); open({str(metrics)!r}, 'w').write('{{}}\\n'); time.sleep(0.2)"
    ended = launch([sys.executable, "-c", write], out=tmp_path, nproc=1, timeout_s=60, env={"PATH": "/usr/bin"})
    assert ended["returncode"] == 0 and 0.2 <= ended["first_record_s"] < ended["wall_s"]
    # steal is the hypervisor's (0 on bare metal): a share of the cores' time, never more than all of it
    assert 0 <= ended["stolen_share"] <= 1 and stolen_seconds() >= 0
