"""--compile's check that inductor can build code here: one line before anything starts, not an error from deep
inside inductor at the first step, on every rank at once. No torch here: the runners' preflight runs it too."""

from __future__ import annotations

import importlib.util
import os
import shutil

from common.errors import ConfigError


def require_compiler(device_type: str) -> None:
    """ConfigError unless inductor can build code for `device_type` (cpu: a C++ compiler; cuda: Triton): said in one
    line here, not from deep inside inductor at the first step, on every rank at once."""
    if device_type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError(
            "--compile: inductor's CPU backend needs a C++ compiler and none was found (g++, clang++ or $CXX); "
            "install one (apt-get install g++) or run without --compile"
        )
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("--compile: inductor's CUDA backend needs Triton; pip install triton, or drop --compile")
