"""run_all.sh and tools.compare on runs of the real scripts: the figure and the table (the refusal of
mismatched runs is tested on hand-written runs in tests/unit)."""

import struct

import pytest

from common.versions import NEEDS_TP, older_than
from tests.helpers import PARITY, markdown_rows, read_metrics
from tests.integration.early import Command

# run_all.sh leaves TP out where the installed torch is older than it needs (docs/versions.md)
RUNS = ("ref", "ddp", "fsdp", "pippy", *(() if older_than(NEEDS_TP) else ("tp",)))
STEPS = 12  # what the comparison needs; the parity itself is tested at length in the strategies' own files


# started with the session (tests/integration/early.py), in a folder of its own
STARTED = {
    "run_all": Command(["bash", "run_all.sh", *PARITY, "--max-steps", str(STEPS)], {"NPROC": "2", "OUT": "{out}"})
}


@pytest.fixture(scope="module")
def run_all(early):
    return early.finished("compare/run_all")


def test_run_all_writes_a_figure(run_all):
    out, stdout = run_all
    png = (out / "compare.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 1000 and height > 600
    assert f"figure: {out / 'compare.png'}" in stdout


def test_table_numbers_match_the_metrics(run_all):
    out, stdout = run_all
    rows = markdown_rows(stdout)
    assert sorted(rows) == sorted(RUNS)
    for name in RUNS:
        train, evals = read_metrics(out / name)
        row = rows[name]
        assert row["final train loss"] == f"{train[max(train)]['loss']:.4f}"
        assert row["test accuracy"] == f"{100 * evals[-1]['test_accuracy']:.2f}%"
        assert row["steps"] == str(len(train)) == str(STEPS)
        assert int(row["world size"]) == (1 if name == "ref" else 2)
    assert all(rows[name]["settings"].startswith(name) for name in RUNS[1:])


def test_equal_runs_have_equal_curves(run_all):
    _, stdout = run_all
    for name, row in markdown_rows(stdout).items():
        assert float(row["max |Δloss| vs ref"]) <= 1e-4, (name, row)
