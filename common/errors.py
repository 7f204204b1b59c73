"""The errors a user can fix. Every entry point turns them into one line and exit code 2 (`fail`)."""

import sys
from typing import NoReturn


class UserError(Exception):
    """Bad input: a flag, a missing data set, an unusable checkpoint. The message says what to do."""


def fail(message: str) -> NoReturn:
    """Print one error line and exit 2: what every entry point does with a UserError."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)
