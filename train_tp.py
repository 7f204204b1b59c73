"""Train BabyCNN, the ViT or BabyGPT with tensor parallelism (TP), alone or with FSDP over the replicas (FSDP x TP).

    bash run_tp.sh                                          # 4 processes: 4-way TP, GPUs + NCCL, else CPU + gloo
    bash run_tp.sh --dp 2                                   # 2 replicas x 2-way TP, FSDP across the replicas
    torchrun --standalone --nproc-per-node 4 train_tp.py    # the same as the first, by hand
    python train_tp.py --max-steps 50                       # 1 process, no torchrun needed

The classifier's linear layers are split across the TP ranks of a replica in column/row pairs (Megatron's):
the first cuts its output features, the second its input features and all-reduces what it outputs, so every
TP rank holds 1/tp of those weights and ends with the whole logits. The convolutions are replicated: every TP
rank of a replica runs them on the same batch (docs/tp.md). BabyGPT's output layer is split by its vocabulary and
its loss computed on those shards (`loss_parallel`): no rank holds the whole logits. Lines specific to TP: `# [TP]`.
"""

import warnings
from contextlib import nullcontext
from typing import Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.model import build_model
from common.model_sizes import check_tp
from common.recorder import RunRecorder
from common.runs import total_steps
from common.training import autocast, build_optimizer, evaluate, global_mean, loss_fn, loss_scaler, lr_at, set_lr


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("tp", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        check_tp(cfg, env.world_size)  # the split and the tokens (the runners check it first)
        train(cfg, env)
    finally:
        teardown_distributed()


class ReplicateParallel(ParallelStyle):
    """[TP] A layer every TP rank runs whole, on the same input: its parameters become replicated DTensors, so
    that every parameter of the model is a DTensor on the same mesh (the fused AdamW refuses a mix of DTensors and
    plain tensors), and it computes on plain tensors as before. torchtitan calls this style NoParallel."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(_: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
            return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=lambda _, y, __: y.to_local())


def apply_tp(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    plan: dict[str, ParallelStyle],
    *,
    dp_mesh: DeviceMesh | None = None,
    dp_units: Sequence[nn.Module | list[nn.Module]] = (),
    compile: bool = False,
) -> nn.Module:
    """[TP] The wrap: the layers of `plan` ({name: ColwiseParallel() or RowwiseParallel()}) split over `tp_mesh`,
    every other layer with parameters replicated on it; with `dp_mesh` (FSDP x TP), FSDP over the replicas: each
    of `dp_units`, then the root. `compile`: torch.compile after the split. python -m planner applies it too."""
    # [TP] A column-wise layer keeps rows out_features / tp of its weight, a row-wise one columns in_features /
    # tp: the first's output is this rank's slice of the features, which the second takes as its input, adds up
    # its partial output with the other TP ranks (an all-reduce) and returns whole. In backward the column-wise
    # layer all-reduces the gradient it returns to the layers before it.
    parallelize_module(model, tp_mesh, plan)
    # [TP] Every module whose parameters the plan left plain tensors, the outermost, replicated whole
    whole: list[str] = []
    for name, module in model.named_modules():
        params, inside = list(module.parameters()), any(name.startswith(w + ".") for w in whole)
        if params and not inside and not any(isinstance(p, DTensor) for p in params):
            whole.append(name)
    parallelize_module(model, tp_mesh, {name: ReplicateParallel() for name in whole})
    if compile:
        # [TP] After the split, so that the graph has DTensor's collectives in it; before FSDP, as in
        # train_fsdp.py: its hooks stay outside the graph. Static shapes (a graph for the training batch, one
        # for the test batch): with symbolic ones inductor fails on FSDP x TP (torch 2.14.1: "mul expected 2
        # arguments, got 3").
        model.compile(dynamic=False)
    if dp_mesh is not None:
        # [TP] FSDP x TP: the replicas shard what TP left to each rank, a unit at a time as torchtitan shards its
        # blocks, then the root for the rest
        for unit in dp_units:
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
    # FSDP (here, or a pipeline's over its replicas) warns, every forward, that the output is a view (TP's
    # to_local() of the last layer's output): only an in-place change of it would matter, and nothing makes one
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    # [TP] A 2-D mesh: "dp" indexes the replicas, "tp" the ranks that split one replica's layers (rank = replica
    # * tp + tp_rank: a replica's TP ranks are neighbours, on one machine where they can be)
    mesh = init_device_mesh(env.device.type, (cfg.dp, env.world_size // cfg.dp), mesh_dim_names=("dp", "tp"))
    replica, tp = mesh.get_local_rank("dp"), mesh["tp"].size()  # [TP] a replica's TP ranks train on its samples
    where = f"{env.device.type}/{env.backend} | torch {torch.__version__}"
    log(f"TP | {env.world_size} processes = {cfg.dp} replica(s) x {tp} TP ranks on {where}")

    # ---- data: every rank holds the whole data set; the sampler gives each replica its slice of each batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this replica runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    model = build_model(**cfg.model_kwargs(), **data.shape).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters")
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    plan = model.tp_plan(cfg.sequence_parallel)  # [TP] the model says which layers split how
    dp_mesh = mesh["dp"] if cfg.dp > 1 else None  # [TP] --dp: FSDP x TP, a unit per block of the model
    model = apply_tp(model, mesh["tp"], plan, dp_mesh=dp_mesh, dp_units=model.blocks(), compile=cfg.compile)
    optimizer = build_optimizer(model.parameters(), cfg)
    scaler = loss_scaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed
    # [TP] BabyGPT's logits stay split by vocabulary (Shard(-1)): the loss on the shards, in forward and backward
    split_loss = loss_parallel if cfg.model == "gpt" else nullcontext

    # resume or start afresh, save every --checkpoint-every steps, and on a preemption signal save and stop
    checkpoints = Checkpoints(cfg, model, [optimizer], scaler, sampler=sampler, steps=steps, log=log)
    if (start_step := checkpoints.start()) is None:
        return  # a finished run: nothing to train, nothing rewritten
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=env.is_main)
    # What this rank keeps between steps, and of it the parameters TP splits (their placement on the last mesh
    # dim, "tp", is a Shard): run.json's memory, per rank
    split = [p for p in model.parameters() if p.placements[-1].is_shard()]
    recorder.track_memory(model.parameters(), optimizer, parts={"split": split})

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)
        # [TP] each replica its shard of the test set; its TP ranks count it alike, which the ratios do not mind
        with split_loss():
            test = evaluate(lambda x, _: model(x), data, part=replica, parts=cfg.dp, device=env.device)
        recorder.eval(step, *test)
        model.train()

    # ---- training loop
    model.train()
    for step in recorder.steps():
        lr = lr_at(step, cfg, last_step=steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        with recorder.span("data"):
            indices = sampler.rank_batch(step, replica, cfg.dp)  # [TP] this replica's slice of the global batch
            images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(zip(images.split(chunk_size), labels.split(chunk_size))):
            # On all but the last accumulation step, skip FSDP's reduce-scatter across the replicas (--dp):
            # gradients accumulate locally and only the last backward reduces their sum, once.
            if cfg.dp > 1:
                model.set_requires_gradient_sync(i == cfg.grad_accum_steps - 1)  # [TP] (FSDP x TP)
            # [TP] the row-wise layers all-reduce their outputs inside forward ("gloo:all_reduce" in the trace)
            with split_loss(), autocast(cfg, env.device), recorder.span("forward"):
                # divided by the accumulation steps, the summed gradients are those of the chunk mean
                loss = loss_fn(model(x), y) / cfg.grad_accum_steps
            # [TP] the column-wise layers all-reduce the gradients they pass back inside backward
            with split_loss(), recorder.span("backward"):
                scaler.scale(loss).backward()
            loss_sum += loss.detach().full_tensor() if isinstance(loss, DTensor) else loss.detach()  # [TP] (BabyGPT's)
        # [TP] --sequence-parallel: each rank's LayerNorms saw its own tokens: their gradients are partial sums
        for p in (p for p in model.parameters() if p.grad is not None and p.grad.placements != p.placements):
            p.grad = p.grad.redistribute(placements=p.placements)  # an all-reduce (FSDP x TP's reduce does it)
        # [TP] Clip once per step, after the last backward, by the whole gradient's norm: each split layer's gradient
        # is a DTensor that says over which mesh dims it is sharded, its squares added over those; the others once
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, loss_scale=scaler.value)
        with recorder.span("optimizer"):
            scaler.step(optimizer, grad_norm)  # fp16: not if the gradients overflowed (the same on every rank)
        # this replica's mean loss (the same on its TP ranks): the mean over all ranks is the global batch's
        recorder.train(step, loss=global_mean(loss_sum), lr=lr, grad_norm=grad_norm, scaler=scaler)
        if recorder.eval_due(step):
            run_eval(step)
        if checkpoints.end_of_step(step, recorder):
            return  # stopped by a preemption signal, with this step's checkpoint

    run_eval(steps)
    split_layers = [name for name, style in plan.items() if isinstance(style, (ColwiseParallel, RowwiseParallel))]
    recorder.finish(mesh={"dp": cfg.dp, "tp": tp}, tp={"split_layers": split_layers})


if __name__ == "__main__":
    run(main)
