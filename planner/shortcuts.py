"""Shortcuts the planner takes through torch's wrap and DTensor's dispatch: each hands back what torch computes, with
less work repeated (torch 2.14.1). Planning a 22 B ViT at 1,024 ranks on fake tensors spent its minutes in them:

- FSDP shards a parameter by chunking it into one view per rank and keeping its own (`_chunk_with_empty`, twice a
  parameter): 1,024 fake views of each of a 22 B ViT's 780 parameters. Here the list makes a view when it is asked
  for one, as torch.chunk makes it (`narrow` at the same offset and length), and the rank's is the only one asked.
- DTensor's sharding propagation of a foreach operator (the fused AdamW step, the gradient norm's) looks, for each
  of its tensors, through the specs of all of them for a _StridedShard (`_propagate_use_strided_shard_flag`): the
  same answer each time, quadratic in the parameters. Here it is looked for once per operator call.

`shortcuts()` applies them for the length of a `with`; planner/measure.py plans each rank inside it.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Iterator

import torch

ON = True  # (tests/unit/test_planner_speed.py plans with them off, to hold them to torch's own results)
USED: Counter[str] = Counter()  # how often each shortcut was taken, in this process


class _Chunks(Sequence):
    """`torch.chunk(tensor, n, dim)`, padded to `n` with empty tensors as FSDP's `_chunk_with_empty` pads it, each
    view made when it is asked for: at::chunk splits into pieces of ceil(size / n) rows (the last one what is left),
    and at::split makes piece i as `narrow(dim, i x rows, its rows)`; a dimension of size 0 gives `n` empty pieces."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        USED["fsdp chunks"] += 1
        self.tensor, self.n, self.dim = tensor, n, dim
        size = tensor.size(dim)
        self.rows = -(-size // n)
        self.pieces = n if size == 0 else max(-(-size // self.rows), 1)  # what torch.chunk returns
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.n))]
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        if i >= self.pieces:  # (torch.chunk made fewer pieces than ranks: FSDP's padding)
            return self[0].new_empty(0)
        start = i * self.rows
        return self.tensor.narrow(self.dim, start, min(self.rows, self.size - start))


@contextmanager
def _lazy_fsdp_chunks() -> Iterator[None]:
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    original = _fsdp_param._chunk_with_empty
    _fsdp_param._chunk_with_empty = _Chunks  # (what _fsdp_param imported by name, and calls)
    try:
        yield
    finally:
        _fsdp_param._chunk_with_empty = original


@contextmanager
def _strided_flag_once() -> Iterator[None]:
    """`_propagate_use_strided_shard_flag(strategy, op_schema)` reads of `op_schema` only its specs (`args_spec`),
    for the flag of those holding a _StridedShard; a foreach operator asks it once per tensor of the same schema.
    The flag is worked out once per schema, and torch's function then given a schema of one spec that carries it
    (or, where no spec holds a _StridedShard, which it leaves alone, not called). The flags are bools, and torch's
    reduction of them is True as soon as one is: the fix-ups between two calls, which set specs' flags to it, leave
    it as it was."""
    from torch.distributed.tensor import _sharding_prop
    from torch.distributed.tensor.placement_types import _StridedShard

    original = _sharding_prop._propagate_use_strided_shard_flag
    last: list[Any] = [None, None]  # the schema last asked about (held: its id stays its own), its stand-in

    def stand_in(op_schema: Any) -> Any:
        flag, carrier = None, None
        for spec in op_schema.args_spec:  # (torch's own reduction of the specs' flags)
            if any(isinstance(p, _StridedShard) for p in spec.placements):
                value = spec.use_strided_shard_as_shard_order
                flag = True if flag is not None and flag != value else value
        if flag is None:
            return None
        for spec in op_schema.args_spec:  # a spec whose flag is the outcome (one has it: the outcome is one's)
            if any(isinstance(p, _StridedShard) for p in spec.placements):
                if spec.use_strided_shard_as_shard_order == flag:
                    carrier = spec
        return SimpleNamespace(args_spec=(carrier,)) if carrier is not None else op_schema

    def propagate(op_strategy: Any, op_schema: Any) -> None:
        if last[0] is not op_schema:
            last[:] = op_schema, stand_in(op_schema)
        else:
            USED["strided flag"] += 1  # (the specs not looked through again)
        if last[1] is not None:
            original(op_strategy, last[1])

    _sharding_prop._propagate_use_strided_shard_flag = propagate
    try:
        yield
    finally:
        _sharding_prop._propagate_use_strided_shard_flag = original
        last.clear()


class _Unmapped(Exception):
    """A propagation's result names a mesh its operator's arguments do not: it is not kept."""


def _meshes(schema: Any) -> list[Any]:
    """The meshes of an OpSchema's DTensor arguments, in their order."""
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.utils._pytree import tree_leaves

    leaves = tree_leaves((schema.args_schema, schema.kwargs_schema), is_leaf=lambda x: isinstance(x, DTensorSpec))
    return [leaf.mesh for leaf in leaves if isinstance(leaf, DTensorSpec)]


def _rebind(found: Any, meshes: dict[int, Any]) -> Any:
    """A copy of `found` (an OutputSharding, or what it holds) whose specs name the meshes `meshes` maps theirs to
    ({id(mesh): mesh}); the placements, shapes and everything else as they are (immutable)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor._dtensor_spec import DTensorSpec
    from torch.distributed.tensor._op_schema import OpSchema, OutputSharding

    if isinstance(found, DeviceMesh):
        if id(found) not in meshes:
            raise _Unmapped
        return meshes[id(found)]
    if isinstance(found, DTensorSpec):
        spec = copy.copy(found)
        spec.mesh = _rebind(found.mesh, meshes)
        return spec
    if isinstance(found, OpSchema):
        schema = copy.copy(found)
        schema.args_schema = _rebind(found.args_schema, meshes)
        schema.kwargs_schema = _rebind(found.kwargs_schema, meshes)
        schema._recompute_comparison_key()
        return schema
    if isinstance(found, OutputSharding):
        return OutputSharding(
            _rebind(found.output_spec, meshes),
            _rebind(found.redistribute_schema, meshes),
            found.needs_redistribute,
            found.use_val_from_redistribute_schema,
        )
    if isinstance(found, (list, tuple)) and not hasattr(found, "_fields"):  # (a TensorMeta is a named tuple)
        return type(found)(_rebind(item, meshes) for item in found)
    if isinstance(found, dict):
        return {k: _rebind(v, meshes) for k, v in found.items()}
    return found


# OpSchema -> (the schema it was worked out for, its OutputSharding with that schema's meshes): kept for the process
_PROPAGATED: dict[Any, tuple[Any, Any]] = {}


@contextmanager
def _sharding_kept_across_worlds() -> Iterator[None]:
    """DTensor's output layouts, worked out once a process for every plan. DTensor caches each operator's in C++,
    keyed by its arguments' specs, mesh included, and a mesh equals another of the same ranks and shape whatever its
    process groups; planner/measure.py clears that cache after each plan, as the next world's equal mesh would find
    this world's process groups in it. Here, on a miss of that cache (`_propagate_op_sharding_dispatch_slow_path`),
    an operator whose layout an earlier plan worked out is given it again, its specs naming this call's meshes: the
    same OutputSharding the propagation would make (a mesh's rank and groups are no part of it).

    Only outside a measured step: there the propagation runs the operator on fake tensors of global shape, which the
    peak's count (common.memory_peak.PeakBytes) sees; the step is measured as before, whatever this cache holds."""
    from torch.distributed.tensor._dispatch import OpDispatcher
    from torch.distributed.tensor._op_schema import OutputSharding
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    original = OpDispatcher._propagate_op_sharding_dispatch_slow_path

    def propagate(self: Any, op_call: Any, args: Any, kwargs: Any, op_info: Any, try_cache: bool) -> Any:
        schema = op_info.schema
        measured = any(not _is_fake_mode(mode) for mode in _get_current_dispatch_mode_stack())
        try:
            kept = _PROPAGATED.get(schema)
        except TypeError:  # (an argument that does not hash)
            return original(self, op_call, args, kwargs, op_info, try_cache)
        if kept is not None and not measured:
            then, now = _meshes(kept[0]), _meshes(schema)
            if len(then) == len(now) and all(a == b for a, b in zip(then, now)):
                try:
                    found = _rebind(kept[1], {id(a): b for a, b in zip(then, now)})
                    USED["layouts kept"] += 1
                    return found
                except _Unmapped:
                    pass
        found = original(self, op_call, args, kwargs, op_info, try_cache)
        if kept is None and isinstance(found, OutputSharding):
            try:  # (a copy: what DTensor does with the one it is given stays its own)
                _PROPAGATED[schema] = (schema, _rebind(found, {id(m): m for m in _meshes(schema)}))
            except _Unmapped:
                pass
        return found

    OpDispatcher._propagate_op_sharding_dispatch_slow_path = propagate  # type: ignore[method-assign]
    try:
        yield
    finally:
        OpDispatcher._propagate_op_sharding_dispatch_slow_path = original  # type: ignore[method-assign]


def _is_fake_mode(mode: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensorMode

    return isinstance(mode, FakeTensorMode)


@contextmanager
def _dtensor_local_parts() -> Iterator[None]:
    """common.distributed.local_part(t) is `t.to_local()` for a DTensor: an autograd function that makes a view of
    its local tensor. The peak's count and measure_memory read of it only its storage, offset, size and element
    size, the local tensor's own: here they are given the local tensor (a view made on a fake DTensor costs as much
    as an operator; a 22 B ViT's state is 2,300 of them)."""
    from torch.distributed.tensor import DTensor

    import common.memory_peak
    import common.recorder

    original = common.memory_peak.local_part

    def local_part(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, DTensor):
            USED["local parts"] += 1
            return t._local_tensor
        return original(t)

    common.memory_peak.local_part = common.recorder.local_part = local_part
    try:
        yield
    finally:
        common.memory_peak.local_part = common.recorder.local_part = original


@contextmanager
def shortcuts() -> Iterator[None]:
    """Plan with the shortcuts above (unless ON is False)."""
    if not ON:
        yield
        return
    with _lazy_fsdp_chunks(), _strided_flag_once(), _sharding_kept_across_worlds(), _dtensor_local_parts():
        yield
