"""The shared launches: every training the collected test modules compare, in one launch per process count.

A test module lists its trainings in a module-level `POOLED` ({name: Run}); the session's `pool` fixture runs
the `POOLED` runs of every module pytest collected, plus the 1-process references, in one launch of
tests/integration/workers/runs.py per process count (1 process first, then the most: a run may start from a
copy of one in an earlier launch, or earlier in its own). Starting Python and torch in four processes costs
more than a 30-step run of BabyCNN, so one launch instead of one per module saves minutes;
`pytest tests/integration/test_fsdp.py` still runs only what that file needs. A module finds its runs under
`pool / "<module without test_>" / name`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import PARITY, PP_PARITY, SGD, Run, run_many

LAUNCH_TIMEOUT_S = 1200  # the 4-process launch trains 49 runs; a hung collective fails after 120 s anyway

# The 1-process runs the distributed runs are compared with: plain training (train_ddp's training loop in a
# world of one, no communication at all). `sgd_1thread` is `sgd` on one thread instead of two: a tolerance
# means something only where the reference itself is stable at that tolerance. `pipeline` is the smaller
# run the pipeline tests compare with, with a checkpoint after step 12 for a pipeline to resume and an
# evaluation after step 10 for the 10-step runs.
REFERENCES = {
    "adamw": Run("ddp", PARITY, nproc=1),
    "sgd": Run("ddp", [*PARITY, *SGD, "--threads", "2"], nproc=1),
    "sgd_1thread": Run("ddp", [*PARITY, *SGD, "--threads", "1"], nproc=1),
    "pipeline": Run("ddp", [*PP_PARITY, "--checkpoint-every", "12", "--eval-every", "10"], nproc=1),
}


@dataclass(frozen=True)
class Pool:
    root: Path  # pool / "fsdp" / "adamw_full" is test_fsdp.py's run "adamw_full"
    output: str  # what the launches printed

    def __truediv__(self, name: str) -> Path:
        return self.root / name


@pytest.fixture(scope="session")
def pool(request, tmp_path_factory) -> Pool:
    runs = {f"references/{name}": run for name, run in REFERENCES.items()}
    for module in sorted({item.module for item in request.session.items}, key=lambda m: m.__name__):
        prefix = module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        runs.update({f"{prefix}/{name}": run for name, run in getattr(module, "POOLED", {}).items()})
    root = tmp_path_factory.mktemp("pool")
    done: set[str] = set()
    printed = []
    # the 1-process references first (other runs resume their checkpoints), then the largest worlds
    for nproc in sorted({run.nproc for run in runs.values()}, key=lambda n: (n != 1, -n)):
        group = {name: run for name, run in runs.items() if run.nproc == nproc}
        for name, run in group.items():
            source = run.rewound_from
            assert source is None or source[0] in done, f"{name} starts from {source[0]}, which no earlier run writes"
            done.add(name)
            (root / name).parent.mkdir(parents=True, exist_ok=True)
        if group:
            printed.append(run_many(group, nproc, root, timeout=LAUNCH_TIMEOUT_S).stdout)
    return Pool(root, "".join(printed))


@pytest.fixture(scope="session")
def references(pool) -> dict[str, Path]:
    return {name: pool / "references" / name for name in REFERENCES}
