"""Commands whose output a module's tests read (`run_all.sh`, `python -m bench --quick`), started with the session's
first test (tests/conftest.py) instead of when the module's first test asks for them: they then run beside the shared
launches, on the cores those leave idle, rather than in pytest's own chain of tests, the suite's critical path once
the launches have ended; the tests that read them are moved to the end of the tests that read no launch
(tests/integration/conftest.py). A module lists its commands in a module-level `STARTED` ({name: Command}); its fixture
reads `early.finished("<module without test_>/<name>")`.
"""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import ROOT, command_failed, env_for_tests


@dataclass(frozen=True)
class Command:
    """`argv` run in the checkout with the tests' environment and `env`; "{out}" in either is its own folder."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 480


class Early:
    """The commands {"<module without test_>/<name>": Command}, each started in a process group of its own, its
    output in its folder under `root`."""

    def __init__(self, commands: dict[str, Command], root: Path) -> None:
        self.commands, self.root = commands, root
        self.started: dict[str, subprocess.Popen] = {}
        for name, command in commands.items():
            out = root / name
            out.mkdir(parents=True)
            with open(out.with_suffix(".stdout"), "w") as stdout, open(out.with_suffix(".stderr"), "w") as stderr:
                self.started[name] = subprocess.Popen(
                    [arg.replace("{out}", str(out)) for arg in command.argv],  # (an argument may hold code)
                    cwd=ROOT,
                    env={**env_for_tests(), **{k: v.replace("{out}", str(out)) for k, v in command.env.items()}},
                    stdout=stdout,
                    stderr=stderr,
                    start_new_session=True,  # (killed whole: kill())
                )

    def finished(self, key: str) -> tuple[Path, str]:
        """The folder of command "<module without test_>/<name>" and what it printed, once it has exited 0 (an
        AssertionError with its output if not)."""
        process, out = self.started[key], self.root / key
        try:
            process.wait(timeout=self.commands[key].timeout_s)
            ended = f"exited {process.returncode}"
        except subprocess.TimeoutExpired:
            kill(process)
            ended = f"ran past its {self.commands[key].timeout_s} s"
        stdout, stderr = out.with_suffix(".stdout").read_text(), out.with_suffix(".stderr").read_text()
        if process.returncode != 0:
            raise command_failed(process.args, ended, stdout, stderr)
        return out, stdout

    def stop(self) -> None:
        for process in self.started.values():
            kill(process)


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)  # (the process group: run_all.sh's torchruns and their workers)
        process.wait()
