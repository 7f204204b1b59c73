"""Resuming: a run resumed from its own checkpoint at the same world size repeats the uninterrupted run bit
for bit, for every strategy, at a learning rate where a 1-ulp difference would grow."""

import pytest

from tests.helpers import SMALL, losses, max_abs_diff, rewind, run_many

STRATEGIES = ("ddp", "fsdp", "pippy")
# --lr 2e-3: AdamW turns a 1-ulp gradient difference into ~1e-3 of loss within ~20 steps, so only an exact
# resume passes max |dloss| == 0 here
EXACT = [
    *SMALL,
    "--max-steps",
    "40",
    "--batch-size",
    "64",
    "--dropout",
    "0",
    "--lr",
    "2e-3",
    "--checkpoint-every",
    "20",
]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """Each strategy's uninterrupted 40-step run, and the same run resumed from its step-20 checkpoint in a
    fresh set of runs (a new DDP wrap, new shards, new stages): two launches of 4 processes in all."""
    root = tmp_path_factory.mktemp("resume")
    run_many({root / s: (s, EXACT) for s in STRATEGIES}, 4)
    for s in STRATEGIES:
        rewind(root / s, root / f"{s}-resumed", 20)
    run_many({root / f"{s}-resumed": (s, [*EXACT, "--resume"]) for s in STRATEGIES}, 4)
    return root


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_resume_at_the_same_world_size_repeats_the_run_bit_for_bit(resumed, strategy):
    full, again = losses(resumed / strategy), losses(resumed / f"{strategy}-resumed")
    assert len(full) == 40
    assert max_abs_diff(full, again) == 0
