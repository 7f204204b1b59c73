"""One rank's memory, measured by running the scripts' own wrap and one training step of it on fake tensors.

In one process, for any world size: a fake process group (`torch.testing._internal.distributed.fake_pg`:
collectives that return at once and move nothing) stands in for the other ranks, and `FakeTensorMode` gives
every tensor a shape, a dtype and a device but no memory, so a 7 B model costs nothing. The model is built
by `common.model.build_model` and wrapped by the scripts' own functions (`apply_ddp`, `fsdp_mesh` and
`apply_fsdp`, `apply_pipeline` and `make_schedule`, `apply_tp`); the optimizer is
`build_optimizer`'s. What this rank holds is counted as a run counts it: `measure_memory` for the state
(run.json's param/grad/optim bytes), and `common.memory_peak.PeakBytes` for the peak of a step (run.json's
peak_bytes with --measure-peak).

DDP cannot be built on fake tensors as the script builds it (its constructor broadcasts the weights and reads
data), so the planner passes init_sync=False and a communication hook that all-reduces each bucket on the fake
group and hands it back as it is (DDP's own hook reads the fake group's empty result), and plans a single step: at
the second, DDP would re-lay its buckets from real data (docs/versions.md). It wraps with the buckets of the steps
after the first (`_buckets_of_later_steps`), and counts them from the moment it allocates them.

With count=True the measured step is also counted (planner/count.py): its operators' FLOPs and bytes, its
collectives, and for a pipeline the order of its actions: what planner/timing.py turns into time.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, ContextManager

import torch
import torch.distributed as dist

from common.config import Config
from common.distributed import DistEnv
from common.memory_peak import PeakBytes, state_tensors
from common.model import build_model
from common.model_sizes import gpt_vocab, input_shape
from common.recorder import measure_memory
from common.training import autocast, build_optimizer, loss_fn
from planner.count import StepCount, StepCounter
from planner.shortcuts import shortcuts


@dataclass
class RankMemory:
    """What one rank holds: run.json's state bytes and the peak of a step, in bytes."""

    rank: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    peak_bytes: int
    parts: dict[str, int] = field(default_factory=dict)  # what the peak holds beyond the state, where known
    # A pipeline rank: one micro-batch's activation it sends, which a real backend may still hold when the
    # program has let go of it (gloo frees a sent tensor once its receiver took it). The peak of a real run lies
    # between peak_bytes and peak_bytes + in_flight_bytes, by the timing of the neighbours.
    in_flight_bytes: int = 0
    count: StepCount | None = field(default=None, repr=False)  # the measured step, counted (count=True)

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


def _fake_world(world_size: int, rank: int) -> None:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())


def _batch(cfg: Config, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of `n` images made as the scripts make theirs (common.data.to_device_batch: gathered uint8 images,
    normalised on the device), so that it counts where theirs does, inside the step."""
    from common.data import NORMALISATION, DataSet, Split, to_device_batch

    if cfg.model == "gpt":  # a language's int64 tokens and next tokens [n, seq_len] (any valid targets)
        tokens = torch.zeros(n, cfg.seq_len, dtype=torch.int64)
        split = Split(tokens, tokens.clone())
        data = DataSet(cfg.dataset, split, split, gpt_vocab(cfg.model_size, cfg.dataset), (), ())
        return to_device_batch(split, torch.arange(n), data, torch.device("cpu"))
    channels, side, classes = input_shape(cfg.model, cfg.model_size, cfg.dataset)
    split = Split(torch.zeros(n, channels, side, side, dtype=torch.uint8), torch.zeros(n, dtype=torch.int64))
    data = DataSet(cfg.dataset, split, split, classes, *NORMALISATION[cfg.dataset])
    return to_device_batch(split, torch.arange(n), data, torch.device("cpu"))


def _warm(params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer | None) -> None:
    """Give the optimizer its state, as after any step of a run (AdamW makes it at its first step)."""
    if optimizer:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _model(cfg: Config):
    kwargs = {**cfg.model_kwargs(), "dropout": 0.0}
    if cfg.model == "gpt":
        return build_model(**kwargs, vocab_size=gpt_vocab(cfg.model_size, cfg.dataset), seq_len=cfg.seq_len)
    channels, side, classes = input_shape(cfg.model, cfg.model_size, cfg.dataset)
    return build_model(**kwargs, in_channels=channels, image_size=side, num_classes=classes)


class _NotCounted:
    """What a step runs in when it is not counted: nothing."""

    count = None

    def __enter__(self) -> _NotCounted:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass

    def phase(self, name: str) -> ContextManager:
        return nullcontext()

    def action(self, name: str) -> ContextManager:
        return nullcontext()


def plan_rank(cfg: Config, world_size: int, rank: int, *, count: bool = False) -> RankMemory:
    """Rank `rank` of `world_size` training `cfg` (its strategy, size, batch, sharding or schedule); with `count`,
    its measured step counted too (RankMemory.count)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    _fake_world(world_size, rank)
    env = DistEnv(rank, 0, world_size, 1, torch.device("cpu"), "fake")
    cfg = replace(cfg, compile=False, grad_accum_steps=1)
    step = {"ddp": _ddp_step, "fsdp": _fsdp_step, "pippy": _pipeline_step, "tp": _tp_step, "cp": _cp_step}
    step = step[cfg.strategy]
    counter = (lambda model: StepCounter(model)) if count else (lambda model: _NotCounted())
    try:
        with shortcuts():
            return step(cfg, env, FakeTensorMode, counter)
    finally:
        dist.destroy_process_group()
        # DTensor caches each operator's output layout, mesh included: the next world's equal mesh would find this
        # world's process groups in it, gone now (sequence parallel's gathers fail to resolve them; torch 2.14.1)
        torch._C._clear_DTensor_sharding_propagator_cache()


def _once_a_step(counted: Any, params: list[torch.nn.Parameter], cfg: Config, *, groups: tuple = ()) -> None:
    """Count what every script runs once a step besides its wrap's step: the gradient norm (common/clipping.py,
    which also clips with --max-grad-norm) and the loss's all-reduce (common/training.global_mean). Each ends by
    reading its number for the log, which a fake tensor has not: the count stops there. After the measured step,
    so not in its planned peak."""
    from torch._subclasses.fake_tensor import DataDependentOutputException

    from common.clipping import clip_grad_norm
    from common.training import global_mean

    if counted.count is None:
        return
    with counted, counted.phase("optimizer"), counted.logging():
        for once in (
            lambda: clip_grad_norm(params, cfg.max_grad_norm, groups=groups),
            lambda: global_mean(torch.zeros(())),
        ):
            try:
                once()
            except DataDependentOutputException:
                pass


def _all_reduce_on_fake_group(state, bucket):  # type: ignore[no-untyped-def]  (DDP reads annotations as objects)
    """DDP's all-reduce of a bucket, on the fake group: nothing moves, the counter sees it."""
    dist.all_reduce(bucket.buffer())
    done = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done


def _buckets_of_later_steps() -> ContextManager:
    """DDP lays every gradient into one bucket for a process's first backward, all-reduced once backward is done,
    and from the second step on into buckets of 25 MiB (the first 1 MiB), each all-reduced beside the rest of backward
    (torch 2.14.1: DistributedDataParallel._ddp_init_helper). The planner plans one step: wrapped with the later
    steps' bucket sizes, it counts their all-reduces. (The rebuilt buckets follow backward's order; these the
    parameters' reverse order, as DDP's first guess: the same sizes, the 1 MiB one last instead of first.)"""
    from unittest import mock

    from torch.nn.parallel import distributed

    config = getattr(distributed, "_BucketCapacityConfig", None)
    if config is None:  # (another torch: tests/unit/test_planner_order.py says so)
        return nullcontext()

    def later(self: Any, static_graph: bool, find_unused_parameters: bool) -> tuple[list[int], list[int]]:
        return [self.first_bucket_bytes_cap, self.bucket_bytes_cap], []

    return mock.patch.object(config, "compute_bucket_size_limits", later)


def _ddp_step(cfg: Config, env: DistEnv, fake_mode: Any, counter: Any) -> RankMemory:
    from train_ddp import apply_ddp

    with fake_mode():
        model = plain = _model(cfg)
        tracker = PeakBytes(model.parameters())
        # DDP allocates its gradient buckets as it wraps: they count from there
        with tracker, _buckets_of_later_steps():
            model = apply_ddp(model, comm_hook=_all_reduce_on_fake_group, init_sync=False)
            optimizer = build_optimizer(model.parameters(), cfg)
            _warm(list(model.parameters()), optimizer)
        buckets = tracker.live
        with tracker, counter(plain) as counted:
            images, labels = _batch(cfg, cfg.chunk_size(env.world_size))
            with autocast(cfg, env.device):  # --precision bf16, fp16: the forward in it, as train_ddp.py runs it
                loss = loss_fn(model(images), labels)
            loss.backward()
            with counted.phase("optimizer"):
                optimizer.step()
        _once_a_step(counted, list(model.parameters()), cfg)
        memory = measure_memory(model.parameters(), optimizer, env.device)
        buckets -= memory["param_bytes"] + memory["optim_bytes"]
    return _result(env.rank, memory, tracker, {"DDP's gradient buckets": buckets}, count=counted.count)


def _fsdp_step(cfg: Config, env: DistEnv, fake_mode: Any, counter: Any) -> RankMemory:
    from common.training import low_precision
    from train_fsdp import apply_fsdp, fsdp_mesh

    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": env.world_size}[cfg.sharding]  # as train_fsdp.py
    mesh = fsdp_mesh("cpu", env.world_size, replicas)  # outside the fake mode: making a mesh communicates
    with fake_mode():
        model = _model(cfg)
        units = model.blocks() if cfg.shard_units == "blocks" else []
        model = apply_fsdp(
            model,
            mesh,
            units=units,
            param_dtype=low_precision(cfg),
            reshard_after_forward=cfg.sharding != "grad-op",
            activation_checkpointing=cfg.activation_checkpointing,
        )
        optimizer = build_optimizer(model.parameters(), cfg)
        _warm(list(model.parameters()), optimizer)
        tracker = PeakBytes(state_tensors(model.parameters(), optimizer))
        with tracker, counter(model) as counted:
            optimizer.zero_grad(set_to_none=True)
            images, labels = _batch(cfg, cfg.chunk_size(env.world_size))
            loss_fn(model(images), labels).backward()
            with counted.phase("optimizer"):
                optimizer.step()
        _once_a_step(counted, list(model.parameters()), cfg)
        memory = measure_memory(model.parameters(), optimizer, env.device)
    return _result(env.rank, memory, tracker, {}, count=counted.count)


def _cp_step(cfg: Config, env: DistEnv, fake_mode: Any, counter: Any) -> RankMemory:
    """train_cp.py's wrap and step: the ring over "cp" (its sends and receives on the fake group, which moves
    nothing: this rank's shapes and memory as a run's), FSDP over every rank; this rank's head and tail chunk of
    each of its replica's sequences, its positions' loss as the script scales it."""
    from torch.distributed.device_mesh import init_device_mesh

    from common.language import IGNORE
    from common.ring_attention import RingAttention
    from common.training import low_precision
    from train_cp import apply_cp, share_of_loss
    from train_fsdp import apply_fsdp, fsdp_mesh

    cp = env.world_size // cfg.dp
    # outside the fake mode: making a mesh communicates
    mesh = init_device_mesh("cpu", (cfg.dp, cp), mesh_dim_names=("dp", "cp"))
    every = fsdp_mesh("cpu", env.world_size)
    ring = RingAttention(mesh["cp"].get_group())
    with fake_mode():
        model = _model(cfg)
        apply_cp(model.attentions(), ring)
        flags = {"param_dtype": low_precision(cfg), "activation_checkpointing": cfg.activation_checkpointing}
        model = apply_fsdp(model, every, units=model.blocks(), **flags)
        optimizer = build_optimizer(model.parameters(), cfg)
        _warm(list(model.parameters()), optimizer)
        tracker = PeakBytes(state_tensors(model.parameters(), optimizer))
        with tracker, counter(model) as counted:
            optimizer.zero_grad(set_to_none=True)
            tokens, targets = _batch(cfg, cfg.chunk_size(env.world_size))  # the replica's sequences, whole
            scored = (targets != IGNORE).sum()
            x, y = ring.shard(tokens), ring.shard(targets)  # this rank's head and tail chunk of each
            share_of_loss(model(x), y, scored=scored, cp=cp).backward()  # (no autocast: FSDP's param_dtype)
            with counted.phase("optimizer"):
                optimizer.step()
        _once_a_step(counted, list(model.parameters()), cfg)
        memory = measure_memory(model.parameters(), optimizer, env.device)
    return _result(env.rank, memory, tracker, {}, count=counted.count)


def _mesh_bookkeeping_for_real() -> Any:
    """FSDP x TP joins "dp" and "tp" into one mesh as it wraps, which computes on the mesh's real rank map: that
    bookkeeping runs outside the fake mode (torch 2.14.1: inside, it fails on a real tensor)."""
    from unittest import mock

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh

    concatenate = DeviceMesh._concatenate

    def concatenate_for_real(meshes: list[DeviceMesh]) -> DeviceMesh:
        with unset_fake_temporarily():
            return concatenate(meshes)

    return mock.patch.object(DeviceMesh, "_concatenate", staticmethod(concatenate_for_real))


def _tp_step(cfg: Config, env: DistEnv, fake_mode: Any, counter: Any) -> RankMemory:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import loss_parallel

    from train_tp import apply_tp

    # outside the fake mode: making a mesh communicates
    mesh = init_device_mesh("cpu", (cfg.dp, env.world_size // cfg.dp), mesh_dim_names=("dp", "tp"))
    with fake_mode(), _mesh_bookkeeping_for_real():
        model = _model(cfg)
        dp_mesh = mesh["dp"] if cfg.dp > 1 else None
        model = apply_tp(
            model, mesh["tp"], model.tp_plan(cfg.sequence_parallel), dp_mesh=dp_mesh, dp_units=model.blocks()
        )
        optimizer = build_optimizer(model.parameters(), cfg)
        split_loss = loss_parallel if cfg.model == "gpt" else nullcontext  # BabyGPT's logits split by vocabulary

        def step(counted: Any) -> None:
            optimizer.zero_grad(set_to_none=True)
            images, labels = _batch(cfg, cfg.chunk_size(env.world_size))  # the replica's batch, on each TP rank
            with split_loss(), autocast(cfg, env.device):  # as train_tp.py runs its forward
                loss = loss_fn(model(images), labels)
            with split_loss():
                loss.backward()
            with counted.phase("backward"):  # as train_tp.py: sequence parallel's norms' partial gradients summed
                for p in (p for p in model.parameters() if p.grad is not None and p.grad.placements != p.placements):
                    p.grad = p.grad.redistribute(placements=p.placements)
            with counted.phase("optimizer"):
                optimizer.step()

        # The first step, as in a run, is not the one measured: DTensor works out the layout of each operator's
        # output on its first call by running it on fake tensors of its own, which a real step 2 no longer does
        step(_NotCounted())
        tracker = PeakBytes(state_tensors(model.parameters(), optimizer))
        with tracker, counter(model) as counted:
            step(counted)
        _once_a_step(counted, list(model.parameters()), cfg)
        memory = measure_memory(model.parameters(), optimizer, env.device)
    return _result(env.rank, memory, tracker, {}, count=counted.count)


def _label_actions(stages: list[Any], counted: Any) -> None:
    """Name each stage action's operators after it ("1F": stage 1's forward; B, I, W as common/pipeline_actions.py)
    and record the order the schedule runs them in, while the step is counted."""

    def labelled(stage: Any, run: Any, fixed: str) -> Any:
        def action(chunk: int, *args: Any, **kw: Any) -> Any:
            kind = fixed or ("B" if kw.get("full_backward", True) else "I")
            if counted.count is not None:
                counted.count.actions.append((stage.stage_index, kind, chunk))
            with counted.action(f"{stage.stage_index}{kind}"):
                return run(chunk, *args, **kw)

        return action

    for stage in stages:
        for attr, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", ""), ("backward_weight_one_chunk", "W")):
            setattr(stage, attr, labelled(stage, getattr(stage, attr), kind))


# (model, its input, stage starts, micro-batch) -> each stage's output shape: the same on every rank of every plan
_STAGE_SHAPES: dict[str, list[tuple[int, ...]]] = {}


def _stage_shapes(cfg: Config, starts: Any, pieces: list[Any], images: torch.Tensor, micro_batch: int) -> list:
    """common.pipeline.stage_output_shapes(pieces, images, micro_batch): a forward of one sample through the whole
    model on fake tensors, worked out once a process for each model, cut and micro-batch."""
    from common.pipeline import stage_output_shapes

    key = repr((cfg.model_kwargs(), cfg.dataset, tuple(starts), tuple(images.shape), images.dtype, micro_batch))
    if key not in _STAGE_SHAPES:
        _STAGE_SHAPES[key] = stage_output_shapes(pieces, images, batch_size=micro_batch)
    return list(_STAGE_SHAPES[key])


def _pipeline_step(cfg: Config, env: DistEnv, fake_mode: Any, counter: Any) -> RankMemory:
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    from common.pipeline import split_model
    from common.pipeline_layout import PipelineLayout
    from train_pippy import apply_pipeline, make_schedule

    layout = PipelineLayout.of(cfg, env.world_size)
    mesh = init_device_mesh("cpu", (layout.dp, layout.pp_size, cfg.tp), mesh_dim_names=("dp", "pp", "tp"))
    mine = layout.stages_of(mesh.get_local_rank("pp"))
    micro_batch = cfg.chunk_size(env.world_size) // cfg.n_microbatches
    with fake_mode(), _mesh_bookkeeping_for_real():
        model = _model(cfg)
        pieces = split_model(model, layout.stage_starts)
        images, _ = _batch(cfg, micro_batch)
        outputs = _stage_shapes(cfg, layout.stage_starts, pieces, images, micro_batch)
        io_shapes = {i: ((tuple(images.shape), *outputs[:-1])[i], outputs[i]) for i in mine}
        sent = [outputs[i] for i in mine if i < layout.n_stages - 1]
        in_flight = max((4 * torch.Size(shape).numel() for shape in sent), default=0)  # fp32 activations
        modules = {i: pieces[i] for i in mine}
        dp_mesh, tp_mesh = (mesh[dim] if mesh[dim].size() > 1 else None for dim in ("dp", "tp"))
        stages = apply_pipeline(
            modules,
            layout.n_stages,
            mesh.get_group("pp"),
            env.device,
            dp_mesh=dp_mesh,
            tp_mesh=tp_mesh,
            tp_plan=model.tp_plan(loss_parallel=False) if cfg.model == "gpt" else model.tp_plan(),  # (train_pippy's)
            io_shapes=io_shapes,
        )
        schedule = make_schedule(cfg.schedule, stages, cfg.n_microbatches, lambda y, t: loss_fn(y.float(), t))
        local = nn.Sequential(*(layer for i in sorted(modules) for layer in modules[i].children()))
        params = list(local.parameters())
        optimizer = build_optimizer(params, cfg) if params else None
        _warm(params, optimizer)
        counted = counter(model)  # (its operators named by the whole model's modules)
        del model, pieces  # the other ranks' stages: this rank does not hold them
        first, last = 0 in mine, layout.n_stages - 1 in mine

        def step(counted: Any) -> None:
            if optimizer:
                optimizer.zero_grad(set_to_none=True)
            images, labels = _batch(cfg, cfg.chunk_size(env.world_size))  # every rank loads it, as in the script
            with autocast(cfg, env.device):  # as train_pippy.py runs its schedule
                schedule.step(
                    *([images] if first else []), target=labels if last else None, losses=[] if last else None
                )
            if optimizer:
                with counted.phase("optimizer"):
                    optimizer.step()

        step(_NotCounted())  # the first step also sets the stages up, as in a run: the one after it is measured
        tracker = PeakBytes(state_tensors(params, optimizer))
        with tracker, counted:
            _label_actions(stages, counted)
            step(counted)
        _once_a_step(counted, params, cfg, groups=(mesh.get_group("pp"),))
        memory = measure_memory(params, optimizer, env.device)
    return _result(env.rank, memory, tracker, {}, in_flight=in_flight, count=counted.count)


def _result(
    rank: int,
    memory: dict[str, Any],
    tracker: PeakBytes,
    parts: dict[str, int],
    *,
    in_flight: int = 0,
    count: StepCount | None = None,
) -> RankMemory:
    return RankMemory(
        rank=rank,
        param_bytes=memory["param_bytes"],
        grad_bytes=memory["grad_bytes"],
        optim_bytes=memory["optim_bytes"],
        peak_bytes=tracker.peak,
        parts=parts,
        in_flight_bytes=in_flight,
        count=count,
    )
