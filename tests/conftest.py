"""Fixtures shared by several test files."""

import pytest

from tests.helpers import PARITY, SGD, launch


@pytest.fixture(scope="session")
def references(tmp_path_factory):
    """The 1-process runs that the DDP and FSDP runs are compared with: plain training, `python train_ddp.py`
    without torchrun, no communication at all. `sgd_1thread` is `sgd` on one thread instead of two: a
    tolerance means something only where the reference itself is stable at that tolerance."""
    root = tmp_path_factory.mktemp("references")
    runs = {"adamw": PARITY, "sgd": [*PARITY, *SGD, "--threads", "2"], "sgd_1thread": [*PARITY, *SGD, "--threads", "1"]}
    for name, flags in runs.items():
        launch("train_ddp.py", 1, flags, root / name)
    return {name: root / name for name in runs}
