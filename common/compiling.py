"""--compile: torch.compile on each module a strategy runs as a whole, after a check that it can.

Each script says *which* modules (the strategy decides); this module holds what is the same everywhere:
`nn.Module.compile()` (in place, so parameter names and checkpoints stay those of the eager model) and
the check that inductor has a compiler for the device, which it would otherwise report only at the first
forward, from deep inside inductor, on every rank at once. It imports torch only to compile, so
common/preflight.py can run the check before torchrun starts any worker.
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


def compile_modules(modules: list[torch.nn.Module], device: torch.device) -> None:
    """Compile each of `modules` in place (a graph per module, traced at its first call)."""
    require_compiler(device.type)
    for module in modules:
        module.compile()


def compile_stages(modules: list[torch.nn.Module], device: torch.device) -> None:
    """Compile each pipeline stage's forward, with the gradients it returns for its inputs made contiguous.

    A stage's input gradients are sent to the previous stage into a buffer laid out like the first one;
    inductor may return them in another layout (a strided view), which gloo refuses to send or receive.
    The pre-hook that fixes the layout runs eagerly, outside the graph, so only `forward` is compiled.
    """
    import torch

    require_compiler(device.type)

    class ContiguousGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad.contiguous()

    def contiguous_input_grads(module: torch.nn.Module, args: tuple) -> tuple:
        return tuple(ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)

    for module in modules:
        module.register_forward_pre_hook(contiguous_input_grads)
        module.forward = torch.compile(module.forward)
