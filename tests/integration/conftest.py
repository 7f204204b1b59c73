"""Fixtures shared by several test files."""

import pytest

from tests.helpers import PARITY, PP_PARITY, SGD, run_many


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The 1-process runs the distributed runs are compared with: plain training (train_ddp's training loop
    in a world of one, no communication at all), all in one process. `sgd_1thread` is `sgd` on one thread
    instead of two: a tolerance means something only where the reference itself is stable at that
    tolerance. `pipeline` is the smaller run the pipeline tests compare with, with a checkpoint after
    step 12 for a pipeline to resume."""
    root = tmp_path_factory.mktemp("references")
    runs = {
        "adamw": PARITY,
        "sgd": [*PARITY, *SGD, "--threads", "2"],
        "sgd_1thread": [*PARITY, *SGD, "--threads", "1"],
        "pipeline": [*PP_PARITY, "--checkpoint-every", "12"],
    }
    run_many({root / name: ("ddp", flags) for name, flags in runs.items()}, 1)
    return {name: root / name for name in runs}
