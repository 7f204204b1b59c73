"""The peak of the tensor bytes a rank holds over one training step, measured the same way in a real run and in
the memory planner's fake one (python -m planner), so the two can be compared.

A CPU has no allocator statistics (torch.cuda.max_memory_allocated's counterpart), so this counts tensors: the
training state that exists before the step (parameters, gradients, optimizer state, given), then every tensor
an operator creates during the step (a TorchDispatchMode sees each one, DTensors as their local shards), and
every storage that FSDP grows or frees in place (UntypedStorage.resize_). A storage leaves the count when it is
freed (a weak reference on it). torch's own trackers (torch.distributed._tools: MemTracker, FSDPMemTracker) do
the same and more, but refuse a module that runs twice in a step (micro-batches, accumulation) and cost half
a second to import.

On glibc the C allocator is asked too (`mallinfo2`: the bytes malloc has handed out and not taken back, whoever
asked, torch's kernels' own workspaces included), after every operator of the step: the same peak as the
allocator saw it, a measurement independent of the counting above (run.json "allocator_peak_bytes").
"""

from __future__ import annotations

import ctypes
import gc
import weakref
from typing import Any, Callable, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

from common.distributed import local_part


class _MallInfo2(ctypes.Structure):  # glibc's struct mallinfo2 (malloc.h), glibc 2.33 and later
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
    ]


def allocator_in_use() -> Callable[[], int] | None:
    """A function that returns the bytes the C allocator has handed out (in its arenas and in mmapped blocks), or
    None where glibc's mallinfo2 is not available (macOS, musl, an older glibc)."""
    try:
        mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    return lambda: (lambda m: m.uordblks + m.hblkhd)(mallinfo2())


class PeakBytes(TorchDispatchMode):
    """`with PeakBytes(state):` counts the bytes of the live tensors, `peak` the most at once. `state`: the tensors
    alive before (their storages are counted once each, however many views share them)."""

    def __init__(self, state: Iterable[torch.Tensor], *, allocator: Callable[[], int] | None = None) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage -> bytes
        self.live = 0
        for tensor in state:
            self._add(tensor)
        self.peak = self.live
        self._resize: Any = None
        # `allocator`: the C allocator's bytes in use, asked after every operator; its growth over the start
        self.allocator, self.allocator_start, self.allocator_peak = allocator, 0, 0

    def _add(self, tensor: torch.Tensor) -> None:
        storage = local_part(tensor).untyped_storage()
        key = storage._cdata  # the storage itself: the planner's fake tensors all have data_ptr 0
        if key not in self.sizes:
            self.sizes[key] = storage.nbytes()
            self.live += self.sizes[key]
            weakref.finalize(storage, self._drop, key)

    def _drop(self, key: int) -> None:
        self.live -= self.sizes.pop(key, 0)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        key = storage._cdata
        if key not in self.sizes:
            self.sizes[key] = 0
            weakref.finalize(storage, self._drop, key)
        self.live += storage.nbytes() - self.sizes[key]
        self.sizes[key] = storage.nbytes()
        self._new_peak()

    def _new_peak(self) -> None:
        self.peak = max(self.peak, self.live)
        if self.allocator:
            self.allocator_peak = max(self.allocator_peak, self.allocator() - self.allocator_start)

    @property
    def allocator_peak_bytes(self) -> int | None:
        """The peak as the C allocator saw it: the state counted at the start plus the most the allocator's bytes
        in use grew over their level then."""
        return self.peak_start + self.allocator_peak if self.allocator else None

    def __enter__(self) -> PeakBytes:
        self.peak = self.peak_start = self.live
        if self.allocator:
            self.allocator_start = self.allocator()
        resize, tracker = torch.UntypedStorage.resize_, self

        def resize_(storage: torch.UntypedStorage, size: int) -> Any:  # how FSDP frees and regrows its buffers
            result = resize(storage, size)
            tracker._resized(storage)
            return result

        self._resize, torch.UntypedStorage.resize_ = resize, resize_
        return super().__enter__()

    def __exit__(self, *args: Any) -> None:
        torch.UntypedStorage.resize_ = self._resize
        super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if any(t.__name__ == "DTensor" for t in types):
            return NotImplemented  # let DTensor turn into local ops, which come back here
        out = func(*args, **(kwargs or {}))
        tree_map_only(torch.Tensor, self._add, out)
        self._new_peak()
        return out


def state_tensors(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """What a rank holds between steps: its parameters, their gradients and the optimizer's state."""
    params = list(params)
    grads = [p.grad for p in params if p.grad is not None]
    state = [v for s in (optimizer.state.values() if optimizer else ()) for v in s.values()]
    return [*params, *grads, *(v for v in state if isinstance(v, torch.Tensor))]


class PeakOfStep:
    """--measure-peak for a RunRecorder: PeakBytes over step `step`, counted from what the step before it left
    (the recorder's parameters, their gradients and the optimizer state: DDP's gradients live on in its buckets)."""

    def __init__(self, step: int, recorder: Any) -> None:
        self.step, self.recorder = step, recorder
        self.tracker: PeakBytes | None = None
        self.bytes: int | None = None  # None: the launch ended before it (a launch of one step)
        self.allocator_bytes: int | None = None  # the same peak as glibc's allocator saw it

    def starts(self, step: int) -> None:
        if step == self.step and self.tracker:
            self.tracker.__enter__()

    def ends(self, step: int) -> None:
        if step == self.step - 1:
            gc.collect()  # nothing unreachable is freed during the step: the allocator's count is the step's own
            state = state_tensors(self.recorder.params, self.recorder.optimizer)
            self.tracker = PeakBytes(state, allocator=allocator_in_use())
        elif step == self.step and self.tracker:
            self.tracker.__exit__(None, None, None)
            self.bytes, self.allocator_bytes = self.tracker.peak, self.tracker.allocator_peak_bytes

    def describe(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "what": "the most tensor bytes the rank held during the step (common/memory_peak.py); "
            "allocator_peak_bytes: the same peak from the C allocator's bytes in use (glibc's mallinfo2) after each "
            "operator",
        }
