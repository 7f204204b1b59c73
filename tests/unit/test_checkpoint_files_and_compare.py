"""Without processes: a checkpoint's files checked against the sizes and checksums its meta.json recorded, the
fall-back to an older checkpoint when the newest is damaged, and `python -m tools.compare` on run folders
written by hand (the table's numbers, the refusal of runs that are not comparable, the figure)."""

import json
from pathlib import Path

import pytest

from common.resume import CheckpointError, latest_checkpoint, verify_checkpoint
from common.runs import checkpoint_dir, fingerprint
from tools.compare import differences, load_run, main, table_rows


def write_checkpoint(out: Path, step: int) -> Path:
    """A committed checkpoint folder as save_checkpoint leaves it: data files, then meta.json listing them."""
    path = Path(checkpoint_dir(str(out))) / f"step_{step:07d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(bytes(range(256)) * 8)
    (path / ".metadata").write_bytes(b"metadata of step %d" % step)
    files = {p.name: fingerprint(str(p)) for p in sorted(path.iterdir())}
    (path / "meta.json").write_text(json.dumps({"step": step, "world_size": 1, "strategy": "ddp", "files": files}))
    return path


def test_verify_names_a_truncated_a_corrupted_and_a_missing_file(tmp_path):
    path = write_checkpoint(tmp_path, 10)
    assert verify_checkpoint(str(path)) is None
    data = path / "__0_0.distcp"
    original = data.read_bytes()
    data.write_bytes(original[:100])
    assert "truncated" in verify_checkpoint(str(path))
    data.write_bytes(original[:-1] + b"\x00")  # same size, one byte changed
    assert "checksum" in verify_checkpoint(str(path))
    data.unlink()
    assert "missing" in verify_checkpoint(str(path))
    (path / "meta.json").write_text("{not json")
    assert "meta.json unreadable" in verify_checkpoint(str(path))


def test_latest_skips_a_damaged_checkpoint_loudly_and_refuses_when_all_are(tmp_path):
    older, newer = write_checkpoint(tmp_path, 10), write_checkpoint(tmp_path, 20)
    (Path(checkpoint_dir(str(tmp_path))) / "step_0000030.tmp").mkdir()  # an uncommitted save: never a candidate
    assert latest_checkpoint(str(tmp_path), log=lambda line: None) == str(newer)
    (newer / "__0_0.distcp").write_bytes(b"")
    warnings = []
    assert latest_checkpoint(str(tmp_path), log=warnings.append) == str(older)
    assert len(warnings) == 1 and str(newer) in warnings[0] and "damaged" in warnings[0]
    (older / ".metadata").unlink()
    with pytest.raises(CheckpointError, match="no checkpoint .* passes verification"):
        latest_checkpoint(str(tmp_path), log=lambda line: None)
    assert latest_checkpoint(str(tmp_path / "fresh"), log=lambda line: None) is None  # no checkpoint at all


def write_run(path: Path, losses: list[float], *, seed: int = 0, world_size: int = 1, model: str = "cnn") -> Path:
    path.mkdir(parents=True)
    config = {"dataset": "digits", "train_size": 1536, "test_size": 256, "batch_size": 96, "seed": seed,
              "model": model, "model_size": "baby", "dropout": 0.0, "precision": "fp32",
              "grad_accum_steps": 1}  # fmt: skip
    per_rank = [{"param_bytes": 4 << 20, "grad_bytes": 4 << 20, "optim_bytes": 8 << 20}] * world_size
    info = {"strategy": "ddp", "world_size": world_size, "config": config, "memory": {"per_rank": per_rank},
            "final": {"train_loss": losses[-1], "test_accuracy": 0.5, "samples_per_s": 1000.0}}  # fmt: skip
    (path / "run.json").write_text(json.dumps(info))
    records = [{"kind": "train", "step": i + 1, "loss": loss, "step_time_s": 0.1} for i, loss in enumerate(losses)]
    records.append({"kind": "eval", "step": len(losses), "test_loss": 1.0, "test_accuracy": 0.5})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_table_reports_the_largest_loss_difference_from_the_reference(tmp_path):
    ref = load_run(str(write_run(tmp_path / "ref", [2.0, 1.5, 1.0])))
    other = load_run(str(write_run(tmp_path / "other", [2.0, 1.25, 1.0], world_size=4)))
    rows = table_rows([ref, other])
    assert rows[0]["max |Δloss| vs ref"] == 0.0 and rows[1]["max |Δloss| vs ref"] == pytest.approx(0.25)
    assert rows[1]["world size"] == 4 and rows[1]["steps"] == 3
    # 16 MiB of state (4 + 4 + 8 MiB) is reported in decimal MB, the docs' and the planner's unit
    assert rows[1]["memory/rank (MB)"] == pytest.approx(16 * 2**20 / 10**6)
    assert differences([ref, other]) == []


def test_runs_that_are_not_comparable_are_refused_unless_forced(tmp_path, capsys):
    ref, seed1 = write_run(tmp_path / "ref", [2.0, 1.0]), write_run(tmp_path / "seed1", [2.1, 1.1], seed=1)
    assert differences([load_run(str(ref)), load_run(str(seed1))]) == [
        f"seed differs: --seed 1 in {seed1} vs 0 in {ref}"
    ]
    vit = write_run(tmp_path / "vit", [2.0, 1.0], model="vit")  # a BabyViT's curve is not BabyCNN's
    assert differences([load_run(str(ref)), load_run(str(vit))]) == [
        f"model differs: --model vit in {vit} vs cnn in {ref}"
    ]
    figure = tmp_path / "c.png"
    assert main([str(ref), str(seed1), "--out", str(figure)]) == 2
    assert "use --force" in capsys.readouterr().err and not figure.exists()
    assert main([str(ref), str(seed1), "--out", str(figure), "--force"]) == 0
    assert figure.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main([str(tmp_path / "missing")]) == 2
    assert "no run.json" in capsys.readouterr().err
