"""The mutation checks' tool (tests/mutations.py): each mutation still names a text its file holds exactly once (else
it would check nothing), the CI subset names mutations that exist, and only a test's own assertion is a catch:
its plugin, run on made-up tests in a pytest of their own, tells a failed assertion from an error anywhere else."""

import json

import pytest

from tests.mutations import CI_SUBSET, MUTATIONS, OUTCOMES, occurrences, verdict


def test_each_mutation_replaces_a_text_its_file_holds_once():
    assert {name: occurrences(name) for name in MUTATIONS if occurrences(name) != 1} == {}
    assert CI_SUBSET and set(CI_SUBSET) <= set(MUTATIONS)


CASES = """
import pytest
from tests.helpers import command_failed

@pytest.fixture
def launch():
    raise AssertionError("the 4-process launch exited 1")

def test_passes():
    pass

def test_reads_what_a_crash_did_not_write():
    {}["loss"]

def test_reads_a_launch(launch):
    pass

def test_runs_a_command_that_crashes():
    raise command_failed(["python", "train_ddp.py"], "exited 1", "", "Traceback (most recent call last):")

def test_asserts():
    assert 1 == 2

def test_after_the_catch():
    pass
"""


def test_only_a_failed_assertion_in_a_test_is_a_catch(tmp_path, monkeypatch):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_cases.py").write_text(CASES)
    monkeypatch.setenv(OUTCOMES, str(tmp_path / "outcomes.jsonl"))
    pytest.main([str(tmp_path), "-q", "-p", "no:cacheprovider", "-p", "tests.mutations", "--rootdir", str(tmp_path)])
    records = [json.loads(line) for line in (tmp_path / "outcomes.jsonl").read_text().splitlines()]
    assert [(r["test"].split("::")[1], r["outcome"], r["when"]) for r in records] == [
        ("test_passes", "passed", "call"),
        ("test_reads_what_a_crash_did_not_write", "error", "call"),
        ("test_reads_a_launch", "error", "setup"),
        ("test_runs_a_command_that_crashes", "error", "call"),  # (command_failed's AssertionError: a crash)
        ("test_asserts", "failure", "call"),  # and the session stops there
    ]
    assert verdict(records, 2, "") == ("caught", "test_cases.py::test_asserts: AssertionError: assert 1 == 2")
    assert verdict(records[:4], 1, "")[0] == "ERROR" and verdict(records[:1], 0, "")[0] == "MISSED"
    assert verdict([], 5, "3 deselected in 0.1s") == ("ERROR", "no test ran (pytest exit 5): 3 deselected in 0.1s")
