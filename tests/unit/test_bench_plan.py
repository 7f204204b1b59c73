"""The benchmark's plan and arithmetic without launching anything: every run it plans is a configuration the
scripts accept (a bad flag fails here in seconds, not minutes into a benchmark), ratios are taken round by round;
and one launch's watch on a process."""

import pytest

from bench.benchmark import Settings, annotate, default_plan
from common.cli import parse_config
from common.versions import NEEDS_V
from tests.helpers import needs_torch

SETTINGS = Settings(batch_size=128, warmup=3, timed=30, test_size=256)


@needs_torch(NEEDS_V)  # the plan runs every schedule, TP too (2.12 both)
def test_every_planned_run_is_a_valid_configuration():
    # the full benchmark takes minutes: a flag combination the scripts reject must fail here, not in it
    plan = default_plan([1, 2, 4])
    assert {"pipeline 1f1b, 2 replicas × 2 stages", "pipeline zbv", "fsdp hybrid"} <= {spec.name for spec in plan}
    for spec in plan:
        if spec.strategy != "baseline":  # every flag of the launch, as the script will parse it
            parse_config(spec.strategy, spec.flags(SETTINGS), world_size=spec.nproc)


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


def test_a_launch_reports_its_first_record_and_the_hypervisors_share(tmp_path):
    import sys

    from bench.launches import launch, stolen_seconds

    metrics = tmp_path / "metrics.jsonl"  # (a launch runs from the suite's root)
    write = f"import time; time.sleep(0.2); open({str(metrics)!r}, 'w').write('{{}}\\n'); time.sleep(0.2)"
    ended = launch([sys.executable, "-c", write], out=tmp_path, nproc=1, timeout_s=60, env={"PATH": "/usr/bin"})
    assert ended["returncode"] == 0 and 0.2 <= ended["first_record_s"] < ended["wall_s"]
    # steal is the hypervisor's (0 on bare metal): a share of the cores' time, never more than all of it
    assert 0 <= ended["stolen_share"] <= 1 and stolen_seconds() >= 0


def test_a_launch_that_fails_says_why_in_one_line(tmp_path):
    import sys

    from bench.launches import launch_and_read

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text("{}\n")  # a previous launch's: cleared first
    said = "import sys; print('step 1'); print('error: --lr: -1 is not positive'); sys.exit(2)"
    row = launch_and_read([sys.executable, "-c", said], out=tmp_path / "run", nproc=1, timeout_s=60, warmup=0,
                          timed=None, batch_size=1)  # fmt: skip
    assert row["returncode"] == 2 and row["error"] == "exit 2: error: --lr: -1 is not positive"
    assert row["first_record_s"] is None and "samples_per_s" not in row
