"""test_plan.py's fake steps, planned ahead. Its tests plan ~100 s of fake steps (planner.measure.plan_rank), one core's
work in pytest's own process, whose chain of tests is the suite's critical path once the shared launches have ended.
So the session starts, with its first test, a process that plans every step the selected tests will ask for, in
their order, at the lowest priority (nice 19): it takes the core time the launches and the other tests leave idle.

A test asks `plans.of(Planned(...))`: a step planned ahead is read; one the background process is planning is waited
for; any other is planned in the test's own process, which first claims it (`<i>.claim`, created once) so that the two
never plan a step twice. A plan is the same wherever it is made (fake tensors, a fake process group of its own), so
what the tests check does not change, only the process that plans it.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import Config
from tests.helpers import ROOT, env_for_tests

if TYPE_CHECKING:
    from planner.measure import RankMemory  # (torch: imported where a step is planned)

# What the planner does not read (its fake step evaluates nothing, writes nothing, builds the model without dropout):
# configurations that differ only there are planned once, so the real runs' plans reuse the closed form's
NOT_PLANNED = ("out", "train_size", "test_size", "max_steps", "log_every", "measure_peak", "dropout")
DEFAULTS = {name: getattr(Config(), name) for name in NOT_PLANNED}


@dataclass(frozen=True)
class Planned:
    """Rank `rank` of `world_size` training `cfg`, its step counted too with `count` (planner/count.py): counting
    costs the fake step of the 201 M ViT a fifth more, and the memory checks read only the peak and the state."""

    cfg: Config
    world_size: int
    rank: int
    count: bool = True

    def plan(self) -> RankMemory:
        from planner.measure import plan_rank  # (torch: in the process that plans)

        return plan_rank(replace(self.cfg, **DEFAULTS), self.world_size, self.rank, count=self.count)

    @property
    def key(self) -> str:
        return repr((replace(self.cfg, **DEFAULTS), self.world_size, self.rank))


def claim(folder: Path, i: int) -> bool:
    """True for the one process that creates `<i>.claim`, the one that plans step i."""
    try:
        os.close(os.open(folder / f"{i}.claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except FileExistsError:
        return False
    return True


class Plans:
    """Each step planned once a session: `wanted` by the background process in `folder`, the rest here."""

    def __init__(self, wanted: list[Planned], folder: Path) -> None:
        ahead: dict[str, Planned] = {}
        for p in wanted:  # each step once, counted if any test counts it
            ahead[p.key] = replace(p, count=p.count or (p.key in ahead and ahead[p.key].count))
        self.wanted = list(ahead.values())
        self.index = {p.key: i for i, p in enumerate(self.wanted)}
        self.folder = folder
        self.memo: dict[str, RankMemory] = {}
        self.mine: set[int] = set()  # the steps this process claimed
        self.process: subprocess.Popen | None = None
        if self.wanted:
            (folder / "wanted.pkl").write_bytes(pickle.dumps(self.wanted))
            with open(folder / "plans.log", "w") as log:  # (the process's warnings, if any)
                worker = [sys.executable, "-m", "tests.integration.workers.plans", str(folder)]
                self.process = subprocess.Popen(worker, cwd=ROOT, env=env_for_tests(), stdout=log, stderr=log)

    def of(self, p: Planned) -> RankMemory:
        """The plan of `p`; a counted plan serves an uncounted request too."""
        known = self.memo.get(p.key)
        if known is None or (p.count and known.count is None):
            i = self.index.get(p.key)
            ahead = i is not None and (self.wanted[i].count or not p.count)
            if ahead:
                p = self.wanted[i]  # (counted here too where any test counts it)
            known = self.memo[p.key] = (ahead and self.read(i)) or p.plan()
        return known

    def read(self, i: int) -> RankMemory | None:
        """The background's plan of step i, waited for while it plans it; None where this process is to plan it."""
        if i in self.mine or claim(self.folder, i):
            self.mine.add(i)
            return None
        done = self.folder / f"{i}.pkl"
        while not done.exists():
            if self.process.poll() is not None or (self.folder / f"{i}.failed").exists():
                return None  # (planned again here, where the test sees its error)
            time.sleep(0.05)
        return pickle.loads(done.read_bytes())

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
