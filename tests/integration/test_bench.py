"""The benchmark itself, on tiny settings: it launches real runs (the suite's DDP on 1 and 2 processes, the
conventional baseline on 2) and writes a JSON whose numbers are real, positive and consistent with each
other and with the runs' own metrics. Nothing here asserts a speed: timing belongs in the benchmark's output,
not in a pass/fail."""

import json
import math
import sys
from pathlib import Path

import pytest

from tests.helpers import read_metrics
from tests.integration.early import Command

# started with the session (tests/integration/early.py), each in a folder of its own
STARTED = {
    "quick": Command([sys.executable, "-m", "bench", "--quick", "--out", "{out}"]),
    "collectives": Command(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
        + ["-m", "bench.collectives", "--quick", "--after-compute", "--out", "{out}"]
    ),
}


@pytest.fixture(scope="module")
def report(early):
    out, _ = early.finished("bench/quick")
    markdown = (out / "bench.md").read_text()
    assert markdown.count("\n| ddp | fp32 |") == 2
    return json.loads((out / "bench.json").read_text())


def positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


def test_peak_and_model_flops(report):
    assert all(positive(v) for v in report["peak_by_threads_gflops"].values())
    layers = {layer["layer"]: layer for layer in report["model"]["layers"]}
    # conv2: 24x24 outputs x 64 channels x (32 x 3 x 3) multiply-adds, x 2 FLOPs, forward
    assert layers["conv2"]["forward"] == 2 * 24 * 24 * 64 * 32 * 9
    assert layers["conv1"]["backward"] == layers["conv1"]["forward"]  # no gradient for the images
    assert layers["conv2"]["backward"] == 2 * layers["conv2"]["forward"]
    assert 70e6 < report["model"]["train_flops_per_sample"] < 73e6  # the "about 72 MFLOP"


def test_every_launch_ran_and_its_numbers_agree_with_its_metrics(report):
    runs = report["runs"]
    assert [(r["strategy"], r["nproc"]) for r in runs] == [("ddp", 1), ("baseline", 2), ("ddp", 2)]
    batch, warmup = report["settings"]["batch_size"], report["settings"]["warmup_steps"]
    last_timed = warmup + report["settings"]["timed_steps"]
    for r in runs:
        assert r["ok"], r.get("error")
        st = r["step_time_s"]
        assert r["timed_steps"] == report["settings"]["timed_steps"]
        assert 0 < st["min"] <= st["p10"] <= st["median"] <= st["p90"] <= st["max"]
        # samples/s is the global batch over the mean step time of the timed steps, read from metrics.jsonl
        train, _ = read_metrics(Path(r["out"]))
        timed = [train[s]["step_time_s"] for s in sorted(train) if warmup < s <= last_timed]
        assert r["samples_per_s"] == pytest.approx(batch * len(timed) / sum(timed))
        assert st["mean"] == pytest.approx(sum(timed) / len(timed))
        # the launch came before the first step, which came before the end of the run
        assert 0 < r["launch_to_first_step_s"] < r["first_record_s"] < r["wall_s"]
        assert len(r["peak_rss_bytes"]) == r["nproc"] and all(positive(v) for v in r["peak_rss_bytes"])
        assert len(r["tensor_bytes_per_rank"]) == r["nproc"] and all(positive(v) for v in r["tensor_bytes_per_rank"])
        assert r["model_gflops"] == pytest.approx(r["samples_per_s"] * report["model"]["train_flops_per_sample"] / 1e9)
        assert r["peak_fraction"] == pytest.approx(r["model_gflops"] / report["peak_gflops"]["fp32"])
    ddp1, baseline2, ddp2 = runs
    # BabyCNN + AdamW state: parameters, gradients and two moments, 4 x 4 bytes per parameter, on every rank
    assert ddp1["tensor_bytes_per_rank"][0] == ddp2["tensor_bytes_per_rank"][1] == baseline2["tensor_bytes_per_rank"][0]
    assert ddp2["vs_baseline"] == pytest.approx(ddp2["samples_per_s"] / baseline2["samples_per_s"])
    assert 0 <= baseline2["data_share"] < 1
    assert 0 <= ddp1["test_accuracy"] <= 1


def test_the_scaling_table_holds_the_runs_on_several_process_counts(report):
    ddp1, _, ddp2 = report["runs"]
    assert report["scaling"] == {"ddp": {"1": ddp1["samples_per_s"], "2": ddp2["samples_per_s"]}}


def test_the_collective_benchmark_in_nccl_tests_terms(early):
    """python -m bench.collectives --quick on 2 processes: every op at a few sizes, time > 0, algbw = size / time,
    busbw = algbw x nccl-tests' factor (2(n-1)/n = 1 for an all-reduce of 2 ranks, (n-1)/n = 0.5 for all-gather),
    the JSON, the table and the figure; --after-compute: an all-reduce after compute, less the compute alone and the
    back-to-back all-reduce."""
    from bench.collectives import OPS, bus_factor

    out, printed = early.finished("bench/collectives")
    report = json.loads((out / "collectives.json").read_text())
    assert report["world_size"] == 2 and {r["op"] for r in report["results"]} == set(OPS)
    for r in report["results"]:
        assert positive(r["time_s"]) and r["algbw_GBps"] == pytest.approx(r["bytes"] / r["time_s"] / 1e9, rel=1e-6)
        assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] * bus_factor(r["op"], 2), rel=1e-6)
    assert bus_factor("all_reduce", 2) == 1 and bus_factor("all_gather", 2) == 0.5
    assert (out / "collectives.png").stat().st_size > 0 and "all_reduce_ring" in printed
    after = report["after_compute"]
    [measured] = after["rounds"]  # --quick: one round
    assert after["bytes"] == 512 << 10 and after["matmuls"] >= 1 and positive(measured["back_to_back_s"])
    assert positive(measured["after_s"]) and positive(measured["compute_s"])  # (no order: 3 calls each, noisy)
    assert after["extra_s"] == pytest.approx(measured["after_s"] - measured["compute_s"] - measured["back_to_back_s"])
    assert "an all-reduce of 512 KiB after compute" in printed
