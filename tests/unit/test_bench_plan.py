"""The benchmark's plan and arithmetic without launching anything: every run it plans is a configuration the
scripts accept (a bad flag fails here in seconds, not minutes into a benchmark), and ratios are taken round
by round."""

import pytest

from bench.benchmark import annotate, default_plan
from common.cli import parse_config


def test_every_planned_run_is_a_valid_configuration():
    # the full benchmark takes minutes: a flag combination the scripts reject must fail here, not in it
    plan = default_plan([1, 2, 4], modes_procs=4, full_runs=True, threads_check=True, bf16=True, more_bf16=True)
    assert {"pipeline 1f1b, 2 replicas × 2 stages", "pipeline zbv", "fsdp hybrid"} <= {spec.name for spec in plan}
    for spec in plan:
        if spec.strategy != "baseline":
            common = ["--precision", spec.precision, "--batch-size", "128"]
            parse_config(spec.strategy, [*spec.args, *common], world_size=spec.nproc)


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
