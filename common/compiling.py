"""--compile: torch.compile on each module a strategy runs as a whole, after a check that it can.

Each script says *which* modules (the strategy decides; a pipeline's stages: common/pipeline.py); this module
holds `nn.Module.compile()` (in place, so parameter names and checkpoints stay those of the eager model) and the
check that inductor has a compiler for the device, which it would otherwise report only at the first forward,
from deep inside inductor, on every rank at once. No torch import, so the preflight runs the check too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from typing import TYPE_CHECKING

from common.config import ConfigError

if TYPE_CHECKING:
    import torch


def require_compiler(device_type: str) -> None:
    """ConfigError unless inductor can build code for `device_type` (cpu: a C++ compiler; cuda: Triton)."""
    if device_type == "cpu" and not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")):
        raise ConfigError(
            "--compile: inductor's CPU backend needs a C++ compiler and none was found (g++, clang++ or $CXX); "
            "install one (apt-get install g++) or run without --compile"
        )
    if device_type == "cuda" and importlib.util.find_spec("triton") is None:
        raise ConfigError("--compile: inductor's CUDA backend needs Triton; pip install triton, or drop --compile")


def compile_modules(modules: list[torch.nn.Module], device: torch.device, *, dynamic: bool | None = None) -> None:
    """Compile each of `modules` in place (a graph per module, traced at its first call). `dynamic`:
    torch.compile's (None: a shape that changes is made symbolic at the recompile; False: a graph per shape)."""
    require_compiler(device.type)
    for module in modules:
        module.compile(dynamic=dynamic)
