"""The errors a user can fix. Every entry point turns them into one line and exit code 2 (runner/entry.py's `fail`)."""


class UserError(Exception):
    """Bad input: a flag, a missing data set, an unusable checkpoint. The message says what to do."""


class ConfigError(UserError, ValueError):
    """A flag has a bad value. The message names the flag and says what to do."""


class WriteError(Exception):
    """A file of the run not written: a full disk, a size limit, a read-only folder (`quiet`: another rank says it)."""

    def __init__(self, message: str, *, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


# torch.save's zip writer (also under DCP) reports a failed write as a RuntimeError of its own
WRITER_FAILED = ("PytorchStreamWriter failed", "file write failed", "inline_container.cc")


def write_error_in(e: BaseException) -> str | None:
    """What was not written, if `e`, its cause or a rank's failure in DCP's CheckpointException is a write error."""
    found = [e, e.__cause__, e.__context__, *(failure[0] for failure in getattr(e, "failures", {}).values())]
    for x in found:
        if isinstance(x, OSError):
            return f"{x.filename}: {x.strerror}" if x.filename else str(x.strerror or x)
        if isinstance(x, RuntimeError) and any(marker in str(x) for marker in WRITER_FAILED):
            return f"the file writer failed: {str(x).strip().splitlines()[0]}"
    return None
