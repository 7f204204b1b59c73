"""The shared launches of tests/integration/conftest.py start with the session's first test, a unit test's too: the
1-process launch, on one core, trains beside the unit tests, which take the other. So do test_plan.py's fake steps,
planned ahead in a background process of their own (tests/integration/plans_ahead.py), and the commands whose output
a module's tests only read (tests/integration/early.py)."""

from __future__ import annotations

from typing import Iterator

import pytest


@pytest.fixture(scope="session", autouse=True)
def launches(request, tmp_path_factory) -> Iterator[object | None]:
    """The shared launches (tests.integration.conftest.Launches), started, or None if no selected test reads them."""
    from tests.integration.conftest import SCHEDULE, Launches, uses_pool  # (imported here: only a session needs it)

    if not any(uses_pool(item) for item in request.session.items):
        yield None
        return
    started = Launches(request.config.stash[SCHEDULE], tmp_path_factory.mktemp("pool"))
    yield started
    started.stop()  # (a session ended early: nothing keeps training after it)


@pytest.fixture(scope="session", autouse=True)
def plans(request, tmp_path_factory) -> Iterator[object]:
    """The steps the selected tests will plan (a module's `planned_by(item)` lists a test's), planned ahead in the
    background: tests.integration.plans_ahead.Plans."""
    from tests.integration.conftest import skipped
    from tests.integration.plans_ahead import Plans

    items = [item for item in request.session.items if hasattr(item.module, "planned_by") and not skipped(item)]
    started = Plans([p for item in items for p in item.module.planned_by(item)], tmp_path_factory.mktemp("plans"))
    yield started
    started.stop()


@pytest.fixture(scope="session", autouse=True)
def early(request, tmp_path_factory) -> Iterator[object]:
    """The commands the selected modules list in `STARTED`, started: tests.integration.early.Early."""
    from tests.integration.conftest import prefix, skipped
    from tests.integration.early import Early

    modules = {item.module for item in request.session.items if not skipped(item)}
    commands = {f"{prefix(m)}/{name}": command for m in modules for name, command in getattr(m, "STARTED", {}).items()}
    started = Early(commands, tmp_path_factory.mktemp("early"))
    yield started
    started.stop()
