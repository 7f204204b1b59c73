"""The shared launches: every training the collected test modules compare, in a few launches (one per process
count, mostly), run in the background while the tests that need none of them run.

A test module lists its trainings in a module-level `POOLED` ({name: Run}); the trainings of every module whose
selected tests read them, plus the 1-process references, run in launches of tests/integration/workers/runs.py,
each one set of processes training one run after another (a run may start from a copy of one trained in an
earlier launch, or earlier in its own). Starting Python and torch in four processes costs more than a 30-step run
of BabyCNN, so a launch per process count instead of one per module saves minutes; `pytest
tests/integration/test_fsdp.py` still runs only what that file needs. A module finds its runs under `pool /
"<module without test_>" / name`; a training two modules ask for alike is trained once and found under both names.

The launches start with the session's first test (a unit test's: tests/conftest.py), in a thread of their own, and
the tests that read them are moved to the end of the session, each module's as soon as the launches holding its runs
have ended: until then the unit tests and the tests that launch their own processes (runners, killed workers, elastic
agents, bad input) run beside them, on the cores the launches' collectives and process starts leave idle (one after
the other, the suite kept both cores ~75 % busy). The tests' order is all that changes: each test checks what it
checked, on runs no other test writes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from common.cli import build_parser
from common.config import STRATEGIES
from common.versions import Need, newer_needs, older_than
from tests.helpers import ONE_THREAD, PARITY, PP_PARITY, SGD, Run, start_many

LAUNCH_TIMEOUT_S = 1200  # the 4-process launch trains 89 runs (~3 min alone here); a hung collective fails in 120 s

# The 1-process runs the distributed runs are compared with: plain training (train_ddp's training loop in a
# world of one, no communication at all), on one thread, as each rank of the 2- and 4-process runs computes on a
# 2-core machine: a tolerance means something only where the reference itself is stable at that tolerance, and a
# run on 1 or 2 threads sums some kernels in another order (on an AVX-512 Xeon, torch 2.14.1, `pipeline` on 1 and
# on 2 threads drifted 3.3e-6 apart in grad_norm within 20 steps, past test_pippy.py's bound, while every pipeline
# and TP run stayed within 7e-8 of the 1-thread one). `sgd` is SGD's on two threads, `sgd_1thread` on one (SGD's
# tolerance covers both). `pipeline` is the smaller run the pipeline tests compare with, with a checkpoint after
# step 12 for a pipeline to resume and an evaluation after step 10 for the 10-step runs.
REFERENCES = {
    "adamw": Run("ddp", [*PARITY, *ONE_THREAD], nproc=1),
    "sgd": Run("ddp", [*PARITY, *SGD, "--threads", "2"], nproc=1),
    "sgd_1thread": Run("ddp", [*PARITY, *SGD, *ONE_THREAD], nproc=1),
    "pipeline": Run("ddp", [*PP_PARITY, *ONE_THREAD, "--checkpoint-every", "12", "--eval-every", "10"], nproc=1),
}


# The launch order: the references first (other runs resume their checkpoints), the 4-process launch, the longest,
# after the short ones, so that the modules whose runs those hold are checked while it trains
ORDER = (1, 8, 2, 3, 4)


def uses_pool(item: pytest.Item) -> bool:
    return "pool" in item.fixturenames  # (every fixture it needs, those its fixtures need included)


def prefix(module) -> str:
    return module.__name__.rsplit(".", 1)[-1].removeprefix("test_")


@dataclass
class Schedule:
    """The launches, [(nproc, {name: run})] in order, and for every run name the index of the launch that trains
    it (its own, or that of the run trained alike under another name, `aliases`)."""

    launches: list[tuple[int, dict[str, Run]]]
    launch_of: dict[str, int]
    aliases: dict[str, str]

    def needed_by(self, module: str) -> int:
        """The last launch a module's tests need: its own runs' and the references'."""
        return max(i for name, i in self.launch_of.items() if name.split("/")[0] in (module, "references"))


def schedule(runs: dict[str, Run]) -> Schedule:
    """Passes over ORDER, each launching every run of a process count whose source (Run.rewound_from) is trained by
    then; a run whose source is not is left for a later launch of its count."""
    launches: list[tuple[int, dict[str, Run]]] = []
    launch_of: dict[str, int] = {}
    aliases: dict[str, str] = {}
    by_training: dict[str, str] = {}
    waiting = dict(runs)
    counts = [*ORDER, *sorted({run.nproc for run in runs.values()} - set(ORDER))]
    while waiting:
        before = len(waiting)
        for nproc in counts:
            group: dict[str, Run] = {}
            for name, run in list(waiting.items()):
                if run.nproc != nproc:
                    continue
                if (source := run.rewound_from) is not None:
                    if source[0] not in launch_of:
                        continue
                    run = replace(run, rewound_from=(aliases.get(source[0], source[0]), source[1]))
                trained_as = by_training.setdefault(repr(run), name)
                if trained_as == name:
                    group[name] = run
                    launch_of[name] = len(launches)
                else:  # trained once, found under both names
                    aliases[name], launch_of[name] = trained_as, launch_of[trained_as]
                del waiting[name]
            if group:
                launches.append((nproc, group))
        if len(waiting) == before:
            raise AssertionError(f"no training writes what these runs start from: {sorted(waiting)}")
    return Schedule(launches, launch_of, aliases)


SCHEDULE = pytest.StashKey[Schedule]()
DROPPED = pytest.StashKey[dict]()
HEAVY_LEFT = pytest.StashKey[set]()


def unmet_need(run: Run) -> Need | None:
    """What of a newer torch than the installed one `run` needs (common/versions.py), if anything."""
    if run.strategy not in STRATEGIES:
        return None
    flags, _ = build_parser(run.strategy).parse_known_args(run.flags)
    needs = newer_needs(run.strategy, tp=getattr(flags, "tp", 1), schedule=getattr(flags, "schedule", ""))
    return next((need for need in needs.values() if older_than(need)), None)


def without_unmet(runs: dict[str, Run]) -> tuple[dict[str, Run], dict[str, Need]]:
    """The runs this torch can train, and those it cannot ({name: need}), a run that starts from one of those too."""
    dropped = {name: need for name, run in runs.items() if (need := unmet_need(run))}
    while more := {n: dropped[r.rewound_from[0]] for n, r in runs.items() if n not in dropped and r.rewound_from
                   and r.rewound_from[0] in dropped}:  # fmt: skip
        dropped.update(more)
    return {name: run for name, run in runs.items() if name not in dropped}, dropped


def skipped(item: pytest.Item) -> bool:
    return any(m.name == "skip" or (m.args and m.args[0] is True) for m in item.iter_markers() if "skip" in m.name)


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    modules = sorted({item.module for item in items if uses_pool(item)}, key=lambda m: m.__name__)
    # a heavy run (Run.heavy: a sweep's further point) is launched only for a module whose heavy tests were selected
    heavy = {item.module for item in items if item.get_closest_marker("heavy")}
    pooled = {f"{prefix(m)}/{name}": (m, run) for m in modules for name, run in getattr(m, "POOLED", {}).items()}
    config.stash[HEAVY_LEFT] = {name for name, (m, run) in pooled.items() if run.heavy and m not in heavy}
    runs = {name: run for name, (_, run) in pooled.items() if name not in config.stash[HEAVY_LEFT]}
    # On an older torch (tests/floor) the runs it cannot train are not launched, and the tests they are a parameter
    # of skip, saying why; a module none of whose tests is left launches nothing
    runs, dropped = without_unmet(runs)
    config.stash[DROPPED] = dropped
    for item in items:
        params = {f"{prefix(item.module)}/{v}" for v in getattr(getattr(item, "callspec", None), "params", {}).values()}
        if uses_pool(item) and (left := params & config.stash[HEAVY_LEFT]) and not item.get_closest_marker("heavy"):
            # (else it fails after the launches, on a run.json never written)
            raise pytest.UsageError(f"{item.nodeid} reads the heavy run {min(left)}: parametrize it with tiered()")
        if uses_pool(item) and (need := next((dropped[p] for p in params if p in dropped), None)):
            (major, minor), what, _ = need
            item.add_marker(pytest.mark.skip(reason=f"{what} needs torch >= {major}.{minor} (docs/versions.md)"))
    modules = [m for m in modules if not all(skipped(i) for i in items if i.module is m and uses_pool(i))]
    runs = {name: run for name, run in runs.items() if name.split("/")[0] in {prefix(m) for m in modules}}
    runs.update({f"references/{name}": run for name, run in REFERENCES.items()})
    plan = config.stash[SCHEDULE] = schedule(runs)
    ends = {module: plan.needed_by(prefix(module)) for module in modules}  # the last launch each module reads
    ends.update({item.module: -1 for item in items if item.module not in ends})  # (all of its tests skip)
    # (stable: the unit tests first, then the integration tests that launch their own, then those of the modules whose
    # commands started with the session (tests/integration/early.py: by then they have ended), then each module's that
    # read the launches, in the order its launches end)
    items.sort(
        key=lambda item: ends[item.module] if uses_pool(item) else -0.5 if hasattr(item.module, "STARTED") else -1
    )


class Launches:
    """The schedule's launches, one after another, in a thread: `wait(i)` returns once launches 0..i have ended
    well, and raises what a failed one printed; `stop()` ends whatever still runs."""

    def __init__(self, plan: Schedule, root: Path) -> None:
        self.plan, self.root = plan, root
        self.running: subprocess.Popen | None = None
        self.ended = 0  # launches ended well
        self.failure: str | None = None
        self.stopped = False
        self.changed = threading.Condition()  # (a launch is either started before stop() or not at all)
        self.prepare(plan, root)
        self.thread = threading.Thread(target=self.launch_all, daemon=True)
        self.thread.start()

    @staticmethod
    def prepare(plan: Schedule, root: Path) -> None:
        """Each module's folder in `root`, and a run trained under another name found under its own too."""
        for name in plan.launch_of:
            (root / name).parent.mkdir(parents=True, exist_ok=True)
        for name, trained_as in plan.aliases.items():  # the folder, what the run printed and its probes (observe.py)
            for suffix in ("", ".log", ".observed"):
                (root / f"{name}{suffix}").symlink_to(root / f"{trained_as}{suffix}")

    def launch_all(self) -> None:
        try:
            self.launch_each()
        except BaseException as error:  # (a launch that could not even start must not leave the tests waiting)
            with self.changed:
                self.failure = f"the launches failed: {error!r}"
                self.changed.notify_all()

    def launch_each(self) -> None:
        for nproc, group in self.plan.launches:
            with self.changed:
                if self.stopped:
                    return
                self.running = start_many(group, nproc, self.root)
            try:
                printed = self.running.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:
                self.stop()
                printed = self.running.communicate()[0]
            with self.changed:
                if self.running.returncode != 0:
                    self.failure = f"the {nproc}-process launch exited {self.running.returncode}:\n{printed[-8000:]}"
                    self.stopped = True
                else:
                    self.ended += 1
                self.changed.notify_all()
            if self.failure:
                return

    def wait(self, launch: int) -> Path:
        with self.changed:
            self.changed.wait_for(lambda: self.ended > launch or self.failure is not None)
        if self.failure:
            raise AssertionError(self.failure)
        return self.root

    def stop(self) -> None:
        with self.changed:
            self.stopped = True
            if self.running is not None and self.running.poll() is None:
                os.killpg(self.running.pid, signal.SIGKILL)  # torchrun and its workers: a session of their own


@dataclass(frozen=True)
class Pool:
    root: Path  # pool / "fsdp" / "adamw_full" is test_fsdp.py's run "adamw_full"

    def __truediv__(self, name: str) -> Path:
        return self.root / name


@pytest.fixture(scope="module")
def pool(request, launches) -> Pool:
    """The launches, once those holding this module's runs (and the references) have ended."""
    return Pool(launches.wait(launches.plan.needed_by(prefix(request.module))))


@pytest.fixture(scope="module")
def untrained(request) -> dict[str, str]:
    """{name: why} of this module's shared runs not trained in this session: those the installed torch cannot train (an
    older one: tests/floor), and the heavy tier's where it was not selected. A test that reads several runs leaves
    these out, or skips saying why."""
    mine = prefix(request.module) + "/"
    why = {
        name: f"{what} needs torch >= {major}.{minor} (docs/versions.md)"
        for name, ((major, minor), what, _) in request.config.stash[DROPPED].items()
    }
    why |= dict.fromkeys(request.config.stash[HEAVY_LEFT], "the heavy tier's (pytest -m heavy)")
    return {name.removeprefix(mine): reason for name, reason in why.items() if name.startswith(mine)}


@pytest.fixture(scope="module")
def references(pool) -> dict[str, Path]:
    return {name: pool / "references" / name for name in REFERENCES}
