"""The torch the suite needs (docs/versions.md), read from the package's metadata, never by importing torch, so
that the runners refuse an older one before torchrun starts and a script before its first collective."""

import re
import sys
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec

from common.errors import ConfigError

Need = tuple[tuple[int, int], str, str]  # (the first release that runs it, what, why not before: measured on gloo)
FLOOR = (2, 11)  # requirements.txt and requirements-floor.txt say the same
NEEDS_TP = ((2, 12), "tensor parallelism", "before it DTensor gives the layers TP replicates twice their gradients")
NEEDS_V = ((2, 12), "a V schedule", "before it gloo fails the sends between a V's two stages on a rank")
NEEDS_PLANNER = ((2, 14), "the planner's fake step", "before it the pipeline's fails on fake tensors")


def installed() -> tuple[int, ...] | None:
    """(major, minor) of the installed torch; None for one without metadata (built from source: not judged)."""
    try:
        return tuple(int(n) for n in re.match(r"(\d+)\.(\d+)", version("torch")).groups())  # type: ignore[union-attr]
    except PackageNotFoundError:
        if find_spec("torch") is None:
            print(
                f"error: no torch in {sys.executable}: pip install -r requirements.txt (or set PYTHON)", file=sys.stderr
            )
            raise SystemExit(2) from None
        return None


def older_than(need: Need) -> bool:
    return (found := installed()) is not None and found < need[0]


def require(need: Need, who: str) -> None:
    """ConfigError naming `who` (a flag, a script) when the installed torch is older than `need`."""
    if older_than(need):
        ((major, minor), what, why), found = need, version("torch")
        raise ConfigError(
            f"{who}: {what} needs torch >= {major}.{minor} ({why}); this is torch {found}: "
            f"pip install 'torch>={major}.{minor}' (docs/versions.md)"
        )


def newer_needs(strategy: str, *, tp: int, schedule: str) -> dict[str, Need]:
    """What the script `strategy` and these flags need beyond the floor, by who needs it."""
    needs = {"train_tp.py": NEEDS_TP} if strategy == "tp" else {"--tp": NEEDS_TP} if tp > 1 else {}
    if strategy == "pippy" and schedule in ("zbv", "dualpipev"):
        needs[f"--schedule {schedule}"] = NEEDS_V
    return needs


def check_torch(strategy: str, *, tp: int, schedule: str) -> None:
    """ConfigError when the installed torch is older than the floor, or than the script or a flag needs."""
    if (found := installed()) and found < FLOOR:
        need = ".".join(map(str, FLOOR))
        raise ConfigError(
            f"this is torch {version('torch')}; the suite needs torch >= {need}: pip install -r requirements.txt"
        )
    for who, need in newer_needs(strategy, tp=tp, schedule=schedule).items():
        require(need, who)
