"""bench.choosing, without launching anything: the quick path's table (BabyCNN baby, every strategy planned), its
rows and columns, its figures the planner's own; the CPU runs' flags the variant the planner lays out; the CPU
column's median after warm-up; bad input as one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench import choosing
from bench.choosing import HEADER, PER_RANK, RANKS, main
from common.versions import NEEDS_PLANNER
from tests.helpers import env_for_tests, needs_torch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("choosing")
    assert main(["--quick", "--out", str(out)]) == 0
    return out


@needs_torch(NEEDS_PLANNER)
def test_the_quick_table_has_a_row_per_strategy_and_every_column(quick: Path) -> None:
    lines = (quick / "choosing.md").read_text().splitlines()
    assert lines[0] == "| " + " | ".join(HEADER) + " |"
    rows = [line[2:-2].split(" | ") for line in lines[2:] if line.startswith("| ")]
    assert all(len(row) == len(HEADER) for row in rows)
    strategies = [row[3] for row in rows]
    assert strategies == ["DDP", "FSDP, a unit per layer", "TP 8", "1F1B, 4 stages × FSDP 2"]
    assert all(row[:3] == ["BabyCNN", "`baby`", "1.3 M"] for row in rows)
    assert [row[9] for row in rows] == ["—"] * 4  # nothing launched on the quick path
    assert [row[10] for row in rows] == ["yes"] * 4  # 1.3 M parameters fit 80 GB in any layout


@needs_torch(NEEDS_PLANNER)
def test_the_figures_are_the_planners_own(quick: Path) -> None:
    from common.config import Config
    from planner.plan import plan
    from planner.report import size
    from planner.timing import load_profile

    rows = json.loads((quick / "choosing.json").read_text())["rows"]
    fsdp = next(r for r in rows if r["variant"] == "fsdp full, a unit per layer")
    base = Config(model="cnn", model_size="baby", batch_size=PER_RANK * RANKS)
    direct = plan(fsdp["variant"], base, RANKS, profile=load_profile("h100-sxm"))
    assert (fsdp["state_bytes"], fsdp["peak_bytes"]) == (direct.worst.state_bytes, direct.worst.peak_bytes)
    assert fsdp["step_s"] == pytest.approx(direct.time.step_s) and fsdp["mfu"] == pytest.approx(direct.time.mfu)
    table = (quick / "choosing.md").read_text()
    assert f"| {size(direct.worst.state_bytes)} | {size(direct.worst.peak_bytes)} |" in table
    ddp = rows[0]  # one rank holds the whole state, 16 bytes per parameter (AdamW adds a step counter per tensor)
    assert ddp["state_bytes"] == pytest.approx(16 * ddp["parameters"], rel=1e-4)
    # and all-reduces every fp32 gradient by the ring: 2 (n - 1) / n of them sent per rank
    assert ddp["sent_bytes"] == pytest.approx(2 * (RANKS - 1) / RANKS * 4 * ddp["parameters"])
    assert fsdp["state_bytes"] < ddp["state_bytes"] / (RANKS - 1)  # sharded over the 8 ranks (and padded)


@pytest.mark.parametrize("model", ["cnn", "vit"])
def test_each_cpu_run_is_the_variant_the_planner_lays_out(model: str) -> None:
    # the measured column must train what the planner planned: its flags, parsed as the runner's processes will
    from common.cli import parse_config
    from common.config import Config
    from planner.plan import variant_config

    for variant in choosing.VARIANTS:
        cfg = variant_config(choosing.variant_name(model, variant), Config(model=model, batch_size=128), 4)
        parsed = parse_config(cfg.strategy, choosing.script_flags(cfg), world_size=4)
        assert {f: getattr(parsed, f) for f in choosing.FLAGS} == {f: getattr(cfg, f) for f in choosing.FLAGS}, variant


def test_cpu_samples_per_s_is_the_median_step_after_warm_up() -> None:
    from bench.launches import timing_stats  # what bench.choosing's CPU column divides the global batch by

    warm_up = [{"step": s, "step_time_s": 5.0} for s in range(1, choosing.WARMUP + 1)]  # slow first steps: left out
    timed = [{"step": choosing.WARMUP + i, "step_time_s": t} for i, t in enumerate([0.1, 0.4, 0.2, 0.3, 9.0], start=1)]
    stats = timing_stats(warm_up + timed, warmup=choosing.WARMUP, timed=None, batch_size=128)
    assert stats["step_time_s"]["median"] == pytest.approx(0.3)


def test_bad_input_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as ended:
        main(["--repeats", "0"])
    assert ended.value.code == 2
    assert capsys.readouterr().err == "error: --repeats: expected at least 1 launch per CPU run, got 0\n"
    # an unknown flag, as a user meets it: one line, no usage block, no traceback
    cmd = [sys.executable, "-m", "bench.choosing", "--quik"]
    done = subprocess.run(cmd, cwd=ROOT, env=env_for_tests(), capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr.splitlines() == ["error: unrecognized arguments: --quik (see --help)"]
