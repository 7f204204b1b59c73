"""Run folders without processes: which settings a resume may change, the refusal line, finished runs, and
moving a previous run aside."""

import dataclasses

import pytest

from common.config import Config
from common.errors import ConfigError
from common.resume import FREE, MAY_CHANGE, TRAJECTORY, check_resume
from common.runs import recorded_config, set_aside
from runner.preflight import finished_line


def test_every_config_field_is_classified_exactly_once():
    """A new flag must be placed: does a resume with another value change the curve (refuse) or not?"""
    names = [f.name for f in dataclasses.fields(Config)]
    classified = [*TRAJECTORY, *MAY_CHANGE, *FREE]
    assert sorted(classified) == sorted(names), set(names) ^ set(classified)


def meta_of(cfg: Config, step: int, *, world_size: int = 4, steps_per_epoch: int = 100) -> dict:
    return {"step": step, "world_size": world_size, **recorded_config(cfg, steps_per_epoch)}


def test_check_resume_refuses_a_trajectory_change_and_names_what_may_change():
    run = Config(out="runs/x", lr=1e-3)
    with pytest.raises(ConfigError, match=r"^--lr: the run in runs/x was trained with --lr 0.001, not 0.002; resume"):
        check_resume(dataclasses.replace(run, lr=2e-3), meta_of(run, 20))
    longer = dataclasses.replace(run, max_steps=80, keep=2)
    assert check_resume(longer, meta_of(run, 20), world_size=2) == (
        "resuming runs/x at step 20 with 4 -> 2 processes, --max-steps 0 -> 80, --keep 0 -> 2"
    )
    assert check_resume(dataclasses.replace(run, threads=3), meta_of(run, 20), world_size=4) == ""
    assert check_resume(run, {"step": 5, "world_size": 4}) == ""  # a checkpoint from before configs were recorded


def test_finished_line_compares_the_checkpoint_with_the_length_asked_for():
    run = Config(out="runs/x", epochs=2, max_steps=0)
    assert finished_line(run, meta_of(run, 200)).startswith("runs/x: already at step 200 of 200")
    assert finished_line(dataclasses.replace(run, epochs=3), meta_of(run, 200)) == ""
    assert finished_line(dataclasses.replace(run, max_steps=150), meta_of(run, 150)) != ""


def test_set_aside_moves_a_run_to_the_next_free_number_and_leaves_other_folders_alone(tmp_path):
    out = tmp_path / "ddp"
    assert set_aside(str(out)) is None  # nothing there
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert set_aside(str(out)) is None  # a folder without a run's files is not a run
    (out / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "ddp.1").mkdir()
    assert set_aside(str(out)) == f"{out}.2"
    assert not out.exists() and (tmp_path / "ddp.2" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "visible,gpus",
    [(None, 4), ("0,1", 2), ("", 0), ("3", 1), ("1,-1,2", 1), ("GPU-5e1f,GPU-77aa", 2), ("0,1,2,3,4", 4)],
)
def test_the_preflight_counts_the_gpus_a_worker_will_see(visible, gpus, monkeypatch):
    """Four NVIDIA device nodes; CUDA_VISIBLE_DEVICES narrows them (CUDA stops at a negative index): the count that
    settles --device auto (CPU unless every process has a GPU) and refuses --device cuda with too few."""
    from runner import preflight

    monkeypatch.setattr(preflight.glob, "glob", lambda pattern: [f"/dev/nvidia{i}" for i in range(4)])
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert preflight.visible_gpus() == gpus
    cfg = Config(device="auto")
    assert preflight.runs_on_cpu(cfg, nproc=4) is (gpus < 4)
    preflight.check_gpus(Config(device="cuda"), gpus)  # as many processes as GPUs: accepted
    with pytest.raises(ConfigError, match=f"--device cuda: {gpus + 1} processes per machine but {gpus} GPU"):
        preflight.check_gpus(Config(device="cuda"), gpus + 1)
