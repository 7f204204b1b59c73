"""The torch the suite needs (common/versions.py): the floor as requirements.txt and CI's floor environment say it,
and one line, not a traceback, for a torch too old for the suite or for a flag, or no torch at all (the metadata
faked here; tests/floor runs the floor's refusals on the real one, in .ci/run)."""

import re
import subprocess
import sys

import pytest

import common.versions as versions
from common.cli import parse_config
from common.errors import ConfigError
from tests.helpers import ROOT, env_for_tests


def test_requirements_and_ci_name_the_floor():
    floor = ".".join(map(str, versions.FLOOR))
    assert re.search(rf"^torch>={re.escape(floor)}$", (ROOT / "requirements.txt").read_text(), re.M)
    assert re.search(rf"^torch=={re.escape(floor)}\.\d+$", (ROOT / "requirements-floor.txt").read_text(), re.M)
    assert "requirements-floor.txt" in (ROOT / ".ci/run").read_text()


@pytest.mark.parametrize(
    "strategy, flags, refused",
    [
        ("tp", [], "train_tp.py: tensor parallelism needs torch >= 2.12"),
        ("pippy", ["--tp", "2"], "--tp: tensor parallelism needs torch >= 2.12"),
        ("pippy", ["--schedule", "dualpipev", "--stages-per-rank", "2"], "--schedule dualpipev: a V schedule needs"),
        ("pippy", ["--schedule", "interleaved-1f1b", "--stages-per-rank", "2"], None),
        ("fsdp", ["--sharding", "hybrid"], None),
    ],
)
def test_a_flag_that_needs_a_newer_torch_is_refused_on_the_floor(monkeypatch, strategy, flags, refused):
    floor = "{}.{}.0+cu130".format(*versions.FLOOR)
    monkeypatch.setattr(versions, "version", lambda _: floor)
    if refused is None:
        parse_config(strategy, flags)
        return
    with pytest.raises(ConfigError, match=re.escape(refused)) as e:
        parse_config(strategy, flags)
    assert f"this is torch {floor}: pip install 'torch>=2.12'" in str(e.value)


def test_a_torch_older_than_the_floor_is_refused_in_one_line_by_the_runners_checks_and_the_scripts(monkeypatch):
    floor = ".".join(map(str, versions.FLOOR))
    refused = f"this is torch 2.7.1; the suite needs torch >= {floor}: pip install -r requirements.txt"
    # the runners' check before torchrun, in a process of its own (the metadata says 2.7.1; it imports no torch)
    old = "import importlib.metadata as m, runpy, sys; m.version = lambda _: '2.7.1'; "
    old += "sys.argv = ['-', 'ddp', '--world-size', '4']; runpy.run_module('runner.preflight', run_name='__main__')"
    proc = subprocess.run([sys.executable, "-c", old], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"error: {refused}\n")
    # a script: parse_config is the first thing each main() does
    monkeypatch.setattr(versions, "version", lambda _: "2.7.1")
    with pytest.raises(ConfigError, match=re.escape(refused)):
        parse_config("ddp", [])


def test_a_runner_given_a_python_without_torch_says_so_in_one_line(tmp_path):
    bare = tmp_path / "python"  # this Python without its site-packages: no torch
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    env = {**env_for_tests(), "PYTHON": str(bare), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", "run_ddp.sh"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert re.fullmatch(r"error: no torch in \S+: pip install -r requirements.txt \(or set PYTHON\)\n", proc.stderr)
