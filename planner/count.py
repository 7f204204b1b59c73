"""What one rank's training step does, counted on the fake tensors the planner runs it on (planner/measure.py):
every operator with its FLOPs (torch.utils.flop_counter's formulas) and the bytes it reads and writes, by module
and phase (forward, backward, optimizer), and every collective as the fake process group sees it: its kind, the
ranks of its group and its size in nccl-tests' terms (an all-gather's output, a reduce-scatter's input).

An operator belongs to the innermost module whose forward runs it; in backward, to the module whose forward made
the autograd node that runs it (each module tags its nodes as its forward returns; torch's ModuleTracker loses
track of a module whose output needs no node of its own, such as dropout at p = 0).

A DTensor's operator is counted as the operator its local shards run (the mode declines the DTensor and sees what
DTensor dispatches), so a TP rank's FLOPs are its share and its collectives those DTensor issues, and the DTensor
call itself apart (`dtensor_calls`: its dispatch in Python costs time of its own); what DTensor runs
on fake tensors of its own to learn an output's shape (a convolution's, at every call) is not counted. The phase is
backward while autograd runs (hooks included: DDP's buckets, FSDP's reduce-scatters), optimizer where the step says
so, else forward. planner/timing.py turns a count into time; docs/time.md says how.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count, sdpa_flop_count

PHASES = ("forward", "backward", "optimizer")
# the mmap threshold common/distributed.keep_freed_memory sets (glibc's largest): a CPU buffer this size or more is
# mapped afresh at each allocation, its pages zero-filled as they are first written
MMAP_THRESHOLD = 32 << 20
DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
aten = torch.ops.aten


def _cpu_sdpa(query, key, value, dropout_p=0.0, is_causal=False, *, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape) // (2 if is_causal else 1)


def _cpu_sdpa_backward(grad_out, query, key, value, out, lse, dropout_p, is_causal, *, out_val=None, **kw) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape) // (2 if is_causal else 1)


# The CPU's attention kernels, which flop_counter's registry (CUDA's kernels) does not name. A causal call (BabyGPT's)
# is counted as half the square: the kernels skip the blocks of scores above the diagonal (the CPU's flash kernel
# and CUDA's alike), so what they compute is about half of what flop_counter's formula, which ignores the mask, says
FLOP_FORMULAS = {
    **flop_registry,
    aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_sdpa_backward,
}

# dispatcher op -> (collective, the argument whose bytes are its size in nccl-tests' terms, whether times the
# group): the c10d ops (FSDP, DDP, the pipeline's P2P) write into their first argument, reduce from their second;
# the functional ones (DTensor) take their input first, an all-gather's output being the group times it
COLLECTIVES = {
    "c10d.allreduce_": ("all_reduce", 0, False),
    "c10d.allreduce_coalesced_": ("all_reduce", 0, False),
    "c10d._allgather_base_": ("all_gather", 0, False),
    "c10d.allgather_": ("all_gather", 0, False),
    "c10d.allgather_into_tensor_coalesced_": ("all_gather", 0, False),
    "c10d._reduce_scatter_base_": ("reduce_scatter", 1, False),
    "c10d.reduce_scatter_": ("reduce_scatter", 1, False),
    "c10d.reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1, False),
    "c10d.broadcast_": ("broadcast", 0, False),
    "c10d.send": ("send", 0, False),
    "c10d.recv_": ("recv", 0, False),
    "_c10d_functional.all_reduce": ("all_reduce", 0, False),
    "_c10d_functional.all_reduce_": ("all_reduce", 0, False),
    "_c10d_functional.all_reduce_coalesced": ("all_reduce", 0, False),
    "_c10d_functional.all_gather_into_tensor": ("all_gather", 0, True),
    "_c10d_functional.all_gather_into_tensor_coalesced": ("all_gather", 0, True),
    "_c10d_functional.reduce_scatter_tensor": ("reduce_scatter", 0, False),
    "_c10d_functional.reduce_scatter_tensor_coalesced": ("reduce_scatter", 0, False),
}


@dataclass(frozen=True)
class Collective:
    kind: str  # all_reduce, all_gather, reduce_scatter, broadcast, send, recv
    group_size: int  # the ranks of its group (2 for a point-to-point op)
    bytes: int  # nccl-tests' size of the collective
    phase: str
    action: str = ""  # the pipeline action it belongs to, e.g. "1F" (stage 1 forward); "" outside one
    first_and_stride: tuple[int, int] = (0, 1)  # its group's first global rank, the stride between them (nodes)
    functional: bool = False  # issued by DTensor (TP): the next operator waits on it
    logged: bool = False  # a number the script logs once a step (the loss, the gradient norm), not the model's
    # what this rank ran since its previous collective: ((StepCount.ops key, calls), ...), DTensor's calls under
    # DTENSOR_CALL (on a CPU a collective costs more the longer the ranks computed before it: planner/timing.py)
    before: tuple = field(default=(), compare=False, repr=False)


DTENSOR_CALL = ("DTensor call",)  # Collective.before's key for DTensor's own dispatch, which runs no operator


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's shape, strides and dtype: what replaying an operator on real tensors needs (bench/machine.py)."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype


@dataclass
class Op:
    """One kind of operator call: `calls` calls of `name` on the same shapes, each `flops` and `bytes` (read and
    written); `call`: the operator and its arguments, tensors as TensorSpecs, to replay it."""

    name: str
    phase: str
    flops: int
    bytes: int
    calls: int = 0
    action: str = ""
    call: tuple[Any, tuple, dict] | None = field(default=None, repr=False)
    dtype: str = "fp32"  # of its first floating-point input: what a GPU's tensor cores run it in
    shapes: tuple = ()  # of its tensor arguments
    signature: str = ""  # its name, overload and arguments that are not tensors: with `shapes`, one kind of call
    fresh_bytes: int = 0  # a call's new storages of MMAP_THRESHOLD or more: on glibc, pages the OS maps afresh


@dataclass
class StepCount:
    ops: dict[tuple, Op] = field(default_factory=dict)  # (name, shapes, phase, action) -> Op
    collectives: list[Collective] = field(default_factory=list)
    module_flops: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # by the innermost module
    actions: list[tuple[int, str, int]] = field(default_factory=list)  # a pipeline's (stage, kind, micro-batch)
    # DTensor operator calls by phase (and pipeline action): each pays DTensor's dispatch in Python besides the
    # operators its shards run (TP's layers; FSDP's and TP's optimizer and gradient norm on sharded parameters)
    dtensor_calls: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    fsdp_units: int = 0  # FSDP's units in the counted model: each runs its hooks in Python, forward and backward

    def flops(self, phase: str | None = None) -> int:
        return sum(op.flops * op.calls for op in self.ops.values() if phase in (None, op.phase))

    def collective_bytes(self) -> dict[str, int]:
        """{kind: bytes} over the step: what planner/predict.traffic predicts as each kind's "bytes". Single numbers
        (the loss, the gradient norm's sums: `logged`) are left out, as there and in the profiler's count."""
        found: dict[str, int] = defaultdict(int)
        for c in (c for c in self.collectives if not c.logged):
            found[c.kind] += c.bytes
        return dict(found)

    def to_json(self) -> dict[str, Any]:
        by_phase = {phase: self.flops(phase) for phase in PHASES}
        calls = {phase: sum(op.calls for op in self.ops.values() if op.phase == phase) for phase in PHASES}
        return {
            "flops": by_phase,
            "operator_calls": calls,
            "collectives": [{k: v for k, v in c.__dict__.items() if k != "before"} for c in self.collectives],
            "module_flops": dict(self.module_flops),
            "actions": self.actions,
            "dtensor_calls": {"/".join(filter(None, k)): n for k, n in self.dtensor_calls.items()},
            "fsdp_units": self.fsdp_units,
        }


def _group(func_name: str, args: tuple, kwargs: dict) -> tuple[int, int, int]:
    """(size, first global rank, stride between global ranks) of the group a collective runs over; for a send or a
    receive, the pair of this rank and its peer."""
    import torch.distributed as dist

    if func_name.startswith("_c10d_functional"):  # (..., group_name): its last argument
        group = dist.distributed_c10d._resolve_process_group(kwargs.get("group_name", args[-1]))
    else:
        found = next(a for a in args if isinstance(a, (dist.ProcessGroup, torch.ScriptObject)))
        group = dist.ProcessGroup.unbox(found) if isinstance(found, torch.ScriptObject) else found
    ranks = dist.get_process_group_ranks(group)
    if func_name in ("c10d.send", "c10d.recv_"):  # (tensors, group, peer's rank in the group, tag)
        me, peer = dist.get_rank(), ranks[args[2]]
        return 2, min(me, peer), abs(peer - me)
    return len(ranks), ranks[0], ranks[1] - ranks[0] if len(ranks) > 1 else 1


def _nbytes(tree: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _outputs(func: Any, out: Any) -> list[tuple[Any, Any]]:
    """(its schema's return, what was returned) for each of a call's returns (one may be a list of tensors: a foreach
    operator's)."""
    returns = func._schema.returns
    return list(zip(returns, [out] if len(returns) == 1 else out or ()))


def _storages(tree: Any) -> set[int]:
    return {t.untyped_storage()._cdata for t in tree_leaves(tree) if isinstance(t, torch.Tensor)}


def _fresh_bytes(func: Any, args: Any, out: Any) -> int:
    """The bytes of the new storages of MMAP_THRESHOLD or more that a call makes (its outputs that alias no input,
    each storage once: FSDP's all-gather input is a view of its output, and a storage its arguments hold was made, and
    counted, by the call that allocated it: FSDP's all-gather output, an `empty` before its copy-in)."""
    held = _storages(args)
    storages = {
        t.untyped_storage()._cdata: t.untyped_storage().nbytes()
        for returned, output in _outputs(func, out)
        if returned.alias_info is None
        for t in tree_leaves(output)
        if isinstance(t, torch.Tensor) and t.untyped_storage()._cdata not in held
    }
    return sum(n for n in storages.values() if n >= MMAP_THRESHOLD)


# In-place operators that overwrite their destination without reading it (`out=` arguments are such too)
OVERWRITES = {"aten.copy_", "aten._foreach_copy_", "aten.fill_", "aten.zero_", "aten._foreach_zero_"}
# FSDP's copy into its all-gather buffer, whose schema says nothing of what it writes: it reads the shards (its first
# argument) and writes them into this rank's slice of the buffer (its first output), none of the rest
COPY_IN = "fsdp.all_gather_copy_in"


def _traffic(func: Any, name: str, args: tuple, kwargs: dict, out: Any) -> int:
    """The bytes a call reads and writes: the tensors it is given, but a destination it only writes (copy_'s, an
    `out=`), and what it writes: its arguments it updates in place and its outputs that are not one of them."""
    if name == COPY_IN:
        return _nbytes(args[0]) + _nbytes(out[0])
    schema = func._schema.arguments
    given = [*zip(schema, args), *((a, kwargs[a.name]) for a in schema if a.name in kwargs)]
    read = written = 0
    for argument, value in given:
        updated = argument.alias_info is not None and argument.alias_info.is_write
        written += _nbytes(value) if updated else 0
        read += 0 if updated and (argument.kwarg_only or name in OVERWRITES) else _nbytes(value)
    # (an in-place operator returns what it updated: counted above)
    written += sum(_nbytes(o) for r, o in _outputs(func, out) if r.alias_info is None or not r.alias_info.is_write)
    return read + written


class StepCounter(TorchDispatchMode):
    """`with StepCounter(model) as counter:` counts every operator and collective into `counter.count`, the
    operators by `model`'s module names; `phase("...")` and `action("...")` name what runs inside them."""

    def __init__(self, model: torch.nn.Module | None = None) -> None:
        super().__init__()
        self.count = StepCount()
        self._phase: str | None = None
        self._action = ""
        self._model = model
        self._names = {id(m): name or "model" for name, m in model.named_modules()} if model is not None else {}
        self._stack: list[str] = []
        self._hooks: list[Any] = []
        self._paused = False
        self._after = ""  # the action that ran last: the schedule sends its output, or its gradient, after it
        self._logged = False
        self._since: dict[tuple, int] = {}  # the operators run since the last collective (Collective.before)

    def __enter__(self) -> StepCounter:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def enter(module: torch.nn.Module, _inputs: Any) -> None:
            self._stack.append(self._names.get(id(module), ""))

        def leave(module: torch.nn.Module, _inputs: Any, output: Any) -> None:
            name = self._stack.pop()
            nodes = [t.grad_fn for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn]
            while nodes:  # tag the autograd nodes this module's forward made (inner modules tagged theirs first)
                node = nodes.pop()
                if node is None or "module" in node.metadata or "AccumulateGrad" in node.name():
                    continue
                node.metadata["module"] = name
                nodes += [n for n, _ in node.next_functions]

        self._hooks = [register_module_forward_pre_hook(enter), register_module_forward_hook(leave)]
        if self._model is not None:
            from torch.distributed.fsdp import FSDPModule

            # (the layers of a unit sharded together share its state)
            states = {id(m._get_fsdp_state()) for m in self._model.modules() if isinstance(m, FSDPModule)}
            self.count.fsdp_units = len(states)
        self._unpatch = self._not_counting_dtensor_shape_runs()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        for hook in self._hooks:
            hook.remove()
        self._unpatch()

    def _not_counting_dtensor_shape_runs(self) -> Any:
        """Pause the count while DTensor runs an operator on fake tensors to learn its output's shape; returns the
        function that undoes it."""
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        original = ShardingPropagator._propagate_tensor_meta_non_cached

        def uncounted(propagator: Any, *args: Any, **kwargs: Any) -> Any:
            self._paused, before = True, self._paused
            try:
                return original(propagator, *args, **kwargs)
            finally:
                self._paused = before

        ShardingPropagator._propagate_tensor_meta_non_cached = uncounted  # type: ignore[method-assign]
        return lambda: setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", original)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._phase, before = name, self._phase
        try:
            yield
        finally:
            self._phase = before

    @contextmanager
    def logging(self) -> Iterator[None]:
        """Collectives inside are the numbers a script logs (Collective.logged)."""
        self._logged = True
        try:
            yield
        finally:
            self._logged = False

    @contextmanager
    def action(self, name: str) -> Iterator[None]:
        self._action, before = name, self._action
        try:
            yield
        finally:
            self._action, self._after = before, name

    def _module(self, phase: str) -> str:
        if phase == "optimizer":
            return "optimizer"
        if self._stack and self._stack[-1]:  # a forward, also one recomputed in backward
            return self._stack[-1]
        node = torch._C._current_autograd_node() if phase == "backward" else None
        return node.metadata.get("module", "") if node is not None else ""

    def _current_phase(self) -> str:
        # the optimizer's phase is set around its step; otherwise autograd's engine running a graph task is backward
        return self._phase or ("backward" if torch._C._current_graph_task_id() != -1 else "forward")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            if not self._paused:
                self.count.dtensor_calls[self._current_phase(), self._action] += 1
                self._since[DTENSOR_CALL] = self._since.get(DTENSOR_CALL, 0) + 1
            return NotImplemented  # DTensor runs it on its local shards, which come back through here
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._paused:
            return out
        name = f"{func.namespace}.{func._opname}"
        phase = self._current_phase()
        if name in COLLECTIVES:
            kind, arg, gathered = COLLECTIVES[name]
            ranks, first, stride = _group(name, args, kwargs)
            size = _nbytes(args[arg]) * (ranks if gathered else 1)
            action = self._action or (self._after if kind in ("send", "recv") else "")
            if ranks > 1:  # (DDP all-reduces over a world of one: nothing moves)
                functional = name.startswith("_c10d_functional")
                before, self._since = tuple(self._since.items()), {}
                found = Collective(kind, ranks, size, phase, action, (first, stride), functional, self._logged, before)
                self.count.collectives.append(found)
            return out
        if name.startswith(("_c10d_functional", "c10d", "prim.")):
            return out  # waits, barriers; a tensor's device asked of the mode (an eager step asks no operator)
        formula = FLOP_FORMULAS.get(func._overloadpacket)
        flops = int(formula(*args, **kwargs, out_val=out)) if formula else 0
        shapes = tuple(tuple(t.shape) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))
        # the overload and the arguments that are not tensors (a convolution's stride, which gradients a backward
        # computes) make calls of the same shapes different work
        settings = repr([a for a in tree_leaves((args, kwargs)) if not isinstance(a, torch.Tensor)])
        key = (f"{name}.{func._overloadname}{settings}", shapes, phase, self._action)
        if key not in self.count.ops:
            spec = lambda t: TensorSpec(tuple(t.shape), tuple(t.stride()), t.dtype)  # noqa: E731
            call = (func, *tree_map_only(torch.Tensor, spec, (args, kwargs)))
            nbytes = _traffic(func, name, args, kwargs, out)
            floats = (t.dtype for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.is_floating_point())
            dtype = DTYPES.get(next(floats, torch.float32), "fp32")
            fresh = _fresh_bytes(func, (args, kwargs), out)
            self.count.ops[key] = Op(name, phase, flops, nbytes, 0, self._action, call, dtype, shapes, key[0], fresh)
        self.count.ops[key].calls += 1
        self._since[key] = self._since.get(key, 0) + 1
        if flops:
            self.count.module_flops[self._module(phase)] += flops
        return out
