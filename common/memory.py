"""Memory preflight for CPU runs: too many processes for the machine's memory cost one line before torchrun
starts, instead of the kernel's OOM killer and a screenful of torchrun noise. No torch here."""

from __future__ import annotations

from common.config import ConfigError

# Memory one CPU training process of this suite takes (torch, the built-in data set, BabyCNN, gloo), rounded up
# from the peak Pss measured per worker (docs/checkpoints.md, "Too many processes", says how). Larger data sets
# take more: a refusal is always right, a launch let through may still be tight.
MIB_PER_CPU_PROCESS = 700


def available_mib() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def check_memory(nproc: int, *, on_cpu: bool) -> None:
    """ConfigError when `nproc` CPU processes cannot fit in the available memory (`on_cpu`: preflight.runs_on_cpu)."""
    available = available_mib()
    if available is None or not on_cpu:
        return
    if nproc * MIB_PER_CPU_PROCESS > available:
        fit = available // MIB_PER_CPU_PROCESS
        raise ConfigError(
            f"NPROC={nproc}: {nproc} CPU processes need ~{nproc * MIB_PER_CPU_PROCESS / 1024:.1f} GiB "
            f"({MIB_PER_CPU_PROCESS} MiB each) but {available / 1024:.1f} GiB are available; at most {fit} fit, "
            f"so use NPROC={max(fit, 1)} or fewer (or free memory)"
        )
