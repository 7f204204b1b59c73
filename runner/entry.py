"""What every command line besides training (the runners' checks, the planner, the tools, the benchmark) does with
a UserError: one line and exit code 2 (a training process does the same in common/distributed.py's `run`)."""

import sys
from typing import NoReturn

from common.errors import ConfigError
from common.versions import Need, require


def fail(message: str) -> NoReturn:
    """Print one error line and exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def require_torch(need: Need, who: str) -> None:
    """One line and exit 2 when the installed torch is older than `need` (common/versions.py) asks for."""
    try:
        require(need, who)
    except ConfigError as e:
        fail(str(e))
