"""The errors a user can fix. Every entry point turns them into one line and exit code 2 (`fail`)."""

import sys
from typing import NoReturn


class UserError(Exception):
    """Bad input: a flag, a missing data set, an unusable checkpoint. The message says what to do."""


def fail(message: str) -> NoReturn:
    """Print one error line and exit 2: what every entry point does with a UserError."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


class WriteError(Exception):
    """A file of the run could not be written: a full disk, a file-size limit, a folder gone read-only. The message
    names the file, the error and the latest intact checkpoint; `quiet` where another rank says it."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def os_error_in(e: BaseException) -> OSError | None:
    """The OSError behind `e`: itself, its cause, or (DCP's CheckpointException) any rank's failure."""
    found = [e, e.__cause__, e.__context__, *(failure[0] for failure in getattr(e, "failures", {}).values())]
    return next((x for x in found if isinstance(x, OSError)), None)
