"""The optional features' own checks, loaded only when one of their flags is given: --compile (inductor can build
code here), --profile-steps, --memory-snapshot, --tensorboard. Each is one line before anything starts, not an error
from deep inside the feature later, on every rank at once. No torch here: the runners' preflight runs them too."""

from __future__ import annotations

import importlib.util
import os
import shutil

from common.errors import ConfigError


def require_compiler(device_type: str) -> None:
    """ConfigError unless inductor can build code for `device_type` (cpu: a C++ compiler; cuda: Triton)."""
    if device_type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError(
            "--compile: inductor's CPU backend needs a C++ compiler and none was found (g++, clang++ or $CXX); "
            "install one (apt-get install g++) or run without --compile"
        )
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("--compile: inductor's CUDA backend needs Triton; pip install triton, or drop --compile")


def check_observability(profile_steps: str, *, memory_snapshot: bool, tensorboard: bool, on_cpu: bool) -> None:
    """ConfigError for --profile-steps that is not A:B, --memory-snapshot on a CPU or without --profile-steps, and
    --tensorboard without the tensorboard package."""
    a, _, b = profile_steps.partition(":")
    if profile_steps and not (a.isdigit() and b.isdigit() and 1 <= int(a) <= int(b)):
        raise ConfigError(f"--profile-steps: expected A:B with 1 <= A <= B (e.g. 3:5), got {profile_steps!r}")
    if memory_snapshot and on_cpu:
        raise ConfigError(
            "--memory-snapshot: needs CUDA (it records the CUDA allocator); this run is on CPU: drop the flag"
        )
    if memory_snapshot and not profile_steps:
        raise ConfigError("--memory-snapshot: records the profiled steps; add --profile-steps A:B (e.g. 3:5)")
    if tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard: the tensorboard package is not installed; pip install tensorboard")
