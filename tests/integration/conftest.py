"""The shared launches: every training the collected test modules compare, in one launch per process count,
run in the background while the tests that need none of them run.

A test module lists its trainings in a module-level `POOLED` ({name: Run}); the `pool` trainings of every module
whose selected tests read them, plus the 1-process references, run in one launch of
tests/integration/workers/runs.py per process count (1 process first, then the most: a run may start from a
copy of one in an earlier launch, or earlier in its own). Starting Python and torch in four processes costs
more than a 30-step run of BabyCNN, so one launch instead of one per module saves minutes;
`pytest tests/integration/test_fsdp.py` still runs only what that file needs. A module finds its runs under
`pool / "<module without test_>" / name`.

The launches start with the first integration test, in a thread of their own, and the tests that read them are
moved to the end of the session: until then the tests that launch their own processes (runners, killed workers,
elastic agents, bad input) run beside them, on the cores that the launches' collectives and process starts leave
idle (one after the other, the suite kept both cores ~75 % busy). The tests' order is all that changes: each test
checks what it checked, on runs no other test touches.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import pytest

from tests.helpers import PARITY, PP_PARITY, SGD, Run, start_many

LAUNCH_TIMEOUT_S = 1200  # the 4-process launch trains 120 runs (~5 min alone here); a hung collective fails in 120 s

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


def uses_pool(item: pytest.Item) -> bool:
    return "pool" in item.fixturenames  # (every fixture it needs, those its fixtures need included)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=uses_pool)  # (stable: the unit tests first, then the integration tests that launch their own)


class Launches:
    """The pool's launches, one process count after another, in a thread: `wait()` returns the pool's root once
    every launch has ended well, and raises what a failed one printed; `stop()` ends whatever still runs."""

    def __init__(self, runs: dict[str, Run], root: Path) -> None:
        self.runs, self.root = runs, root
        self.running: subprocess.Popen | None = None
        self.failure: str | None = None
        self.stopped = False
        self.lock = threading.Lock()  # (a launch is either started before stop() or not at all)
        self.thread = threading.Thread(target=self.launch_all, daemon=True)
        self.thread.start()

    def launch_all(self) -> None:
        trained: dict[str, str] = {}  # {name: the name whose run it is}: two modules may ask for the same training
        by_training: dict[str, str] = {}
        # the 1-process references first (other runs resume their checkpoints), then the largest worlds
        for nproc in sorted({run.nproc for run in self.runs.values()}, key=lambda n: (n != 1, -n)):
            group = {}
            for name, run in self.runs.items():
                if run.nproc != nproc:
                    continue
                if (source := run.rewound_from) is not None:
                    if source[0] not in trained:
                        self.failure = f"{name} starts from {source[0]}, which no earlier run writes"
                        return
                    run = replace(run, rewound_from=(trained[source[0]], source[1]))
                trained[name] = by_training.setdefault(repr(run), name)
                (self.root / name).parent.mkdir(parents=True, exist_ok=True)
                if trained[name] == name:
                    group[name] = run
                else:  # trained once, found under both names: the folder and what the run printed
                    for suffix in ("", ".log"):
                        (self.root / f"{name}{suffix}").symlink_to(self.root / f"{trained[name]}{suffix}")
            if not group:
                continue
            with self.lock:
                if self.stopped:
                    return
                self.running = start_many(group, nproc, self.root)
            try:
                printed = self.running.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:
                self.stop()
                printed = self.running.communicate()[0]
            if self.running.returncode != 0:
                self.failure = f"the {nproc}-process launch exited {self.running.returncode}:\n{printed[-8000:]}"
                return

    def wait(self) -> Path:
        self.thread.join()
        if self.failure:
            raise AssertionError(self.failure)
        return self.root

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            if self.running is not None and self.running.poll() is None:
                os.killpg(self.running.pid, signal.SIGKILL)  # torchrun and its workers: a session of their own


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[Launches | None]:
    runs = {f"references/{name}": run for name, run in REFERENCES.items()}
    modules = {item.module for item in request.session.items if uses_pool(item)}
    for module in sorted(modules, key=lambda m: m.__name__):
        prefix = module.__name__.rsplit(".", 1)[-1].removeprefix("test_")
        runs.update({f"{prefix}/{name}": run for name, run in getattr(module, "POOLED", {}).items()})
    if not modules:
        yield None
        return
    started = Launches(runs, tmp_path_factory.mktemp("pool"))
    yield started
    started.stop()  # (a session ended early: nothing keeps training after it)


@dataclass(frozen=True)
class Pool:
    root: Path  # pool / "fsdp" / "adamw_full" is test_fsdp.py's run "adamw_full"

    def __truediv__(self, name: str) -> Path:
        return self.root / name


@pytest.fixture(scope="session")
def pool(launches) -> Pool:
    return Pool(launches.wait())


@pytest.fixture(scope="session")
def references(pool) -> dict[str, Path]:
    return {name: pool / "references" / name for name in REFERENCES}
