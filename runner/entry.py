"""What every command line besides training (the runners' checks, the planner, the tools, the benchmark) does with
a UserError: one line and exit code 2 (a training process does the same in common/distributed.py's `run`)."""

import sys
from typing import NoReturn


def fail(message: str) -> NoReturn:
    """Print one error line and exit 2."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
