"""run_all.sh and tools.compare on runs of the real scripts: the figure and the table (the refusal of
mismatched runs is tested on hand-written runs in tests/unit)."""

import json
import struct

import pytest

from common.versions import NEEDS_TP, older_than
from tests.helpers import PARITY, markdown_rows, read_metrics, read_run
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


def test_the_figure_draws_each_run_in_each_panel_with_every_point_it_logged(run_all):
    """compare.png.json, what tools.compare drew read back from the figure's panels: every run's curve in every panel,
    with as many points as the run logged (steps, learning rates, gradient norms, evaluations), the reference's
    |Δloss| left out, one throughput bar per run and one memory bar per rank."""
    out, _ = run_all
    figure = json.loads((out / "compare.png.json").read_text())
    logged = {name: read_metrics(out / name) for name in RUNS}
    trains = {name: train for name, (train, _) in logged.items()}
    logging = lambda key: {name: sum(r.get(key) is not None for r in t.values()) for name, t in trains.items()}  # noqa: E731
    steps, rates, norms = logging("loss"), logging("lr"), logging("grad_norm")
    assert set(steps.values()) == {STEPS}
    evals = {name: len(evaluations) for name, (_, evaluations) in logged.items()}
    assert set(evals.values()) == {1}  # the last step's (run_all.sh evaluates every 20 steps)
    expected = {
        "training loss per step": steps,
        "training loss against training time": steps,
        "test accuracy at each evaluation": evals,
        "learning rate per step": rates,
        "|loss - loss of ref| per step (equal: drawn at 1e-9)": {name: steps[name] for name in RUNS[1:]},
        "global gradient norm before clipping": norms,  # (PARITY does not clip: no threshold line)
    }
    panels = {panel["title"]: panel for panel in figure["panels"]}
    assert len(panels) == len(figure["panels"]) == 8, list(panels)
    for title, points in expected.items():
        curves = [(curve["name"], curve["points"]) for curve in panels[title]["curves"]]
        assert curves == list(points.items()) and panels[title]["bars"] == {}, (title, curves)
    world_sizes = {name: read_run(out / name)["world_size"] for name in RUNS}
    memory = "memory per rank: parameters + gradients + optimizer state\n(one bar per rank; dotted: CUDA peak)"
    assert panels["training throughput"]["bars"] == dict.fromkeys(RUNS, 1)
    assert panels[memory]["bars"] == world_sizes == {name: 1 if name == "ref" else 2 for name in RUNS}
    assert panels[memory]["curves"] == []  # no CUDA peak on a CPU
    assert [label.split(" ")[0] for label in figure["legend"]] == list(RUNS)
    assert figure["title"] == "BabyCNN on digits, global batch 48, seed 0"


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
