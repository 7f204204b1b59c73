"""Train BabyCNN with tensor parallelism (TP), alone or with FSDP over the replicas (FSDP x TP, a 2-D mesh).

    bash run_tp.sh                                          # 4 processes: 4-way TP, GPUs + NCCL, else CPU + gloo
    bash run_tp.sh --dp 2                                   # 2 replicas x 2-way TP, FSDP across the replicas
    torchrun --standalone --nproc-per-node 4 train_tp.py    # the same as the first, by hand
    python train_tp.py --max-steps 50                       # 1 process, no torchrun needed

The classifier's linear layers are split across the TP ranks of a replica in column/row pairs (Megatron's):
the first cuts its output features, the second its input features and all-reduces what it outputs, so every
TP rank holds 1/tp of those weights and ends with the whole logits. The convolutions are replicated: every TP
rank of a replica runs them on the same batch (docs/tp.md). Lines specific to TP are marked `# [TP]`.
"""

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from common.checkpoint import checkpoint_to_resume, load_checkpoint, save_checkpoint, set_aside_previous_run
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, describe_data, load_dataset, to_device_batch
from common.distributed import (
    DistEnv,
    RankLogger,
    run,
    seed_everything,
    setup_distributed,
    stop_requested,
    teardown_distributed,
)
from common.model import BabyCNN, build_model
from common.model_sizes import tp_pairs, tp_state_bytes_theory
from common.recorder import RunRecorder
from common.runs import already_done, total_steps
from common.traffic import Traffic, add, padded_shard
from common.training import LossScaler, autocast, build_optimizer, evaluate, global_mean, low_precision, lr_at, set_lr


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("tp", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
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


def tp_plan(model: BabyCNN, size: str) -> dict[str, ParallelStyle]:
    """[TP] The classifier's linear layers in column/row pairs: fc1 column-wise, the next row-wise, and so on
    (common/model_sizes.py pairs them for each size). The convolutions, and an odd last linear layer, are
    replicated."""
    plan: dict[str, ParallelStyle] = {}
    for col, row in tp_pairs(size):
        plan[col], plan[row] = ColwiseParallel(), RowwiseParallel()
    replicated = [name for name, layer in model.named_children() if name not in plan and list(layer.parameters())]
    return plan | {name: ReplicateParallel() for name in replicated}


def tp_mesh(cfg: Config, env: DistEnv) -> DeviceMesh:
    """[TP] A 2-D mesh: "dp" indexes the replicas, "tp" the ranks that split one replica's layers (rank = replica
    * tp + tp_rank: a replica's TP ranks are neighbours, on one machine where they can be)."""
    return init_device_mesh(env.device.type, (cfg.dp, env.world_size // cfg.dp), mesh_dim_names=("dp", "tp"))


def apply_tp(model: BabyCNN, mesh: DeviceMesh, cfg: Config, env: DistEnv) -> nn.Module:
    """[TP] The wrap: the pairs split over "tp" (parallelize_module), then, with --dp, FSDP over "dp": each
    replica's TP shards sharded again across the replicas. python -m planner applies it too."""
    # [TP] A column-wise layer keeps rows out_features / tp of its weight, a row-wise one columns in_features /
    # tp: the first's output is this rank's slice of the features, which the second takes as its input, adds up
    # its partial output with the other TP ranks (an all-reduce) and returns whole. In backward the column-wise
    # layer all-reduces the gradient it returns to the layers before it.
    parallelize_module(model, mesh["tp"], tp_plan(model, cfg.model_size))
    if cfg.compile:
        from common.compiling import compile_modules  # only with the flag, like every optional feature

        # [TP] After the split, so that the graph has DTensor's collectives in it; before FSDP, as in
        # train_fsdp.py: its hooks stay outside the graph. Static shapes (a graph for the training batch, one
        # for the test batch): with symbolic ones inductor fails on FSDP x TP (torch 2.14.1: "mul expected 2
        # arguments, got 3").
        compile_modules([model], env.device, dynamic=False)
    if cfg.dp > 1:
        # [TP] FSDP x TP: the replicas shard what TP left to each rank, in units as torchtitan shards its blocks:
        # each linear layer (gathered over "dp" one at a time), then the root for the rest
        for layer in model.children():
            if isinstance(layer, nn.Linear):
                fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        # FSDP warns, every forward, that the logits are a view (TP's to_local() of the last layer's output):
        # only an in-place change of them would matter, and nothing makes one
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def tp_traffic(model: BabyCNN, cfg: Config, env: DistEnv) -> Traffic:
    """[TP] What each rank moves per step (run.json "traffic"; docs/communication.md), from the model before the
    split: per pair and accumulation step, an all-reduce over "tp" of the row-wise layer's output in forward and
    of the column-wise layer's input gradient in backward; with --dp, FSDP over "dp" of what TP leaves each rank
    (a linear layer gathered before its forward and again before its backward, the root once; each unit's
    gradients reduce-scattered once)."""
    tp, chunk, steps = env.world_size // cfg.dp, cfg.chunk_size(env.world_size), cfg.grad_accum_steps
    itemsize = (low_precision(cfg) or torch.float32).itemsize  # autocast's activations
    traffic: Traffic = {}
    split_dim = {}  # parameter -> the dim TP splits: a column-wise layer's rows (and bias), a row-wise one's columns
    for col, row in tp_pairs(cfg.model_size):
        # forward: the row-wise layer's output; backward: the gradient of the column-wise layer's input
        for features in (getattr(model, row).out_features, getattr(model, col).in_features):
            add(traffic, "all_reduce", elements=chunk * features, itemsize=itemsize, ranks=tp, times=steps)
        split_dim |= {
            id(getattr(model, col).weight): 0,
            id(getattr(model, col).bias): 0,
            id(getattr(model, row).weight): 1,
        }
    if cfg.dp > 1:

        def shard(p: nn.Parameter) -> int:  # this rank's TP part of p, sharded again over "dp"
            shape = list(p.shape)
            if id(p) in split_dim:
                shape[split_dim[id(p)]] //= tp
            return padded_shard(tuple(shape), cfg.dp)

        linears = [list(layer.parameters()) for layer in model.children() if isinstance(layer, nn.Linear)]
        in_units = {id(p) for params in linears for p in params}
        root = [p for p in model.parameters() if id(p) not in in_units]
        for params, gathers in [*((params, 2) for params in linears), (root, 1)]:
            elements = cfg.dp * sum(shard(p) for p in params)
            add(traffic, "all_gather", elements=elements, itemsize=4, ranks=cfg.dp, times=gathers * steps)
            add(traffic, "reduce_scatter", elements=elements, itemsize=4, ranks=cfg.dp)
    return traffic


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    mesh = tp_mesh(cfg, env)  # [TP]
    replica = mesh.get_local_rank("dp")  # [TP] every TP rank of a replica trains on the same samples
    log(
        f"TP | {env.world_size} processes = {cfg.dp} replica(s) x {env.world_size // cfg.dp} TP ranks on "
        f"{env.device.type}/{env.backend} | torch {torch.__version__}"
    )

    # ---- data: every rank holds the whole data set; the sampler gives each replica its slice of each batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this replica runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    model = build_model(
        size=cfg.model_size,
        seed=cfg.seed,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        dropout=cfg.dropout,
    ).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"BabyCNN {cfg.model_size}: {n_params:,} parameters")
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    traffic = tp_traffic(model, cfg, env)  # [TP] (before the split: the layers' whole shapes)
    model = apply_tp(model, mesh, cfg, env)  # [TP]
    optimizer = build_optimizer(model.parameters(), cfg)
    scaler = LossScaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed

    start_step = 0
    if path := checkpoint_to_resume(cfg, log=log):
        start_step = load_checkpoint(path, model=model, optimizers=[optimizer], scaler=scaler)
        log(f"resumed from {path} (step {start_step})")
    else:
        set_aside_previous_run(cfg)  # a new run: a previous one in --out moves to <out>.N, never overwritten
    if start_step >= steps:  # a finished run: nothing to train, nothing to rewrite
        log(already_done(cfg.out, start_step, steps))
        return
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=env.is_main)
    # [TP] What this rank keeps between steps, and of it the parameters TP splits (the pairs' weights, the
    # column-wise layers' biases): their placement on the last mesh dim, "tp", is a Shard.
    split = [p for p in model.parameters() if p.placements[-1].is_shard()]
    recorder.track_memory(model.parameters(), optimizer, parts={"split": split})

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)
        # [TP] each replica its shard of the test set; its TP ranks count it alike, which the ratios do not mind
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
            with autocast(cfg, env.device), recorder.span("forward"):
                # divided by the accumulation steps, the summed gradients are those of the chunk mean
                loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps
            # [TP] the column-wise layers all-reduce the gradients they pass back inside backward
            with recorder.span("backward"):
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # [TP] Clip once per step, after the last backward, by the norm of the whole gradient: each split layer's
        # gradient is a DTensor that says over which mesh dims it is sharded, and its squares are added over
        # those; the replicated layers (the convolutions) count once.
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, loss_scale=scaler.value)
        with recorder.span("optimizer"):
            scaler.step(optimizer, grad_norm)  # fp16: not if the gradients overflowed (the same on every rank)
        # loss_sum is this replica's mean loss (the same on its TP ranks): the mean over all ranks is the mean
        # over the whole global batch
        recorder.train(step, loss=global_mean(loss_sum), lr=lr, grad_norm=grad_norm, scaler=scaler)
        if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
            run_eval(step)
        # preemption: SIGTERM/SIGUSR1 on any rank, learnt by all ranks here (after the last step the run just ends)
        stop = stop_requested() if step < steps else None
        if stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            save_checkpoint(
                cfg, step, model=model, optimizers=[optimizer], scaler=scaler, steps_per_epoch=sampler.steps_per_epoch
            )
        if stop:  # every rank saved this step: a resumed run repeats the uninterrupted one bit for bit
            log(f"stopped by {stop} after step {step} of {steps}, with its checkpoint: --resume continues")
            recorder.close()
            return

    run_eval(steps)
    tp = mesh["tp"].size()
    theory = tp_state_bytes_theory(cfg.model_size, tp=tp, dp=cfg.dp, optimizer=cfg.optimizer, dataset=cfg.dataset)
    split_layers = [list(pair) for pair in tp_pairs(cfg.model_size)]
    recorder.finish(
        traffic=traffic, memory_theory=theory, mesh={"dp": cfg.dp, "tp": tp}, tp={"split_layers": split_layers}
    )


if __name__ == "__main__":
    run(main)
