"""Train BabyCNN with FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

    bash run_fsdp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_fsdp.py   # the same, by hand
    python train_fsdp.py --max-steps 50                      # 1 process, no torchrun needed

Each rank keeps a shard of every parameter, gradient and optimizer state; a unit's shards are all-gathered
before it runs and its gradients reduce-scattered after its backward (docs/fsdp.md). Lines specific to FSDP
are marked `# [FSDP]`.
"""

import contextlib
import os
from typing import Sequence

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.errors import WriteError
from common.model import build_model
from common.recorder import RunRecorder
from common.runs import latest_checkpoint_line, total_steps
from common.training import build_optimizer, evaluate, global_mean, loss_fn, loss_scaler, low_precision, lr_at, set_lr


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("fsdp", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        train(cfg, env)
    finally:
        teardown_distributed()


def fsdp_mesh(device_type: str, world_size: int, replicas: int = 1) -> DeviceMesh:
    """[FSDP] The device mesh: the ranks of a "shard" row split every parameter; with `replicas` > 1 (HSDP) each
    row holds the same shards again and the rows all-reduce their gradients over "replicate"."""
    if replicas == 1:
        return init_device_mesh(device_type, (world_size,), mesh_dim_names=("shard",))
    return init_device_mesh(device_type, (replicas, world_size // replicas), mesh_dim_names=("replicate", "shard"))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    *,
    units: Sequence[nn.Module | list[nn.Module]] = (),
    param_dtype: torch.dtype | None = None,
    reshard_after_forward: bool = True,
    offload: bool = False,
    activation_checkpointing: bool = False,
    compile: bool = False,
) -> nn.Module:
    """[FSDP] The wrap: `fully_shard` on each of `units` (a module, or a list of layers sharded together), then on
    the root for the rest, over `mesh`. `param_dtype` (bf16, fp16): compute in it, keep fp32 shards and reduce
    gradients in fp32; `reshard_after_forward=False` keeps the gathered parameters for backward (ZeRO-2);
    `offload`: shards, gradients and optimizer state in CPU memory. Returns the model to train (in a checkpoint
    wrapper with `activation_checkpointing`). python -m planner shards with it too."""
    if activation_checkpointing:
        # [FSDP] Keep only each block's input for backward and recompute its activations there (a second forward),
        # wrapped before sharding, as torchtitan orders them; a model of layer lists is one span, checkpointed whole.
        # Checkpoint keys stay block0.attn.q.weight (docs/fsdp.md)
        wrapped = {id(unit): checkpoint_wrapper(unit) for unit in units if isinstance(unit, nn.Module)}
        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if id(child) in wrapped:
                    setattr(parent, name, wrapped[id(child)])  # [FSDP] the block, in its wrapper, in its place
        units = [wrapped.get(id(unit), unit) for unit in units]
        model = model if wrapped else checkpoint_wrapper(model)
    # [FSDP] Mixed precision replaces DDP's autocast: the gathered parameters are cast, the shards stay fp32; the
    # units hand each other param_dtype, the root returns fp32 logits for the loss
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()
    shard = dict(mesh=mesh, mp_policy=mixed, offload_policy=offload_policy)
    if compile:
        # [FSDP] Compile before sharding. FSDP2's hooks (all-gather before a unit, reduce-scatter after its
        # backward) are marked for dynamo to leave out, so the graph breaks at each unit's boundary: a graph
        # per unit, with the collectives run eagerly between them, as torchtitan does per block.
        model.compile()
    # [FSDP] Each fully_shard call makes a unit (an all-gather before it, a reduce-scatter after its backward),
    # one unit's full parameters at a time; the last unit and the root keep theirs after forward, because their
    # backward follows at once.
    for i, unit in enumerate(units):
        fully_shard(unit, reshard_after_forward=reshard_after_forward and i < len(units) - 1, **shard)
    root_mixed = MixedPrecisionPolicy(
        param_dtype, mixed.reduce_dtype, output_dtype=torch.float32 if param_dtype else None
    )
    fully_shard(model, reshard_after_forward=False, **{**shard, "mp_policy": root_mixed})
    return model


def save_model_file(state: dict, out_dir: str) -> None:
    """model.pt, a plain state dict for inference, written whole or not at all: one line if it cannot be."""
    path = os.path.join(out_dir, "model.pt")
    try:
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)
    except (OSError, RuntimeError) as e:  # torch.save's writer raises RuntimeError ("file write failed")
        with contextlib.suppress(OSError):
            os.remove(path + ".tmp")
        where = latest_checkpoint_line(out_dir)
        raise WriteError(
            f"{path} not written ({e}); {where}: make room; the checkpoints hold the trained weights too"
        ) from None


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    log(f"FSDP {cfg.sharding} | {env.world_size} ranks on {env.device.type}/{env.backend} | torch {torch.__version__}")

    # ---- data: every rank holds the whole data set; the sampler gives each rank its slice of each batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this rank runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    # [FSDP] Built whole on the CPU, then sharded (fully_shard moves each shard to the device): DDP's initial
    # weights, so the curves compare. Big models use the meta device instead (docs/fsdp.md).
    model = build_model(**cfg.model_kwargs(), **data.shape)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters")
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    moes = model.moes() if cfg.experts else []  # --experts: BabyGPT's MoE layers, whose balance losses join the loss
    # [FSDP] The flags as the wrap's arguments: hybrid shards over 2 rows of world/2 ranks, none over 1 (NO_SHARD);
    # --shard-units blocks: a unit per block (the model's own), model: the root alone (fewest collectives)
    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": env.world_size}[cfg.sharding]
    mesh = fsdp_mesh(env.device.type, env.world_size, replicas)  # [FSDP]
    model = apply_fsdp(  # [FSDP]
        model,
        mesh,
        units=model.blocks() if cfg.shard_units == "blocks" else [],
        param_dtype=low_precision(cfg),
        reshard_after_forward=cfg.sharding != "grad-op",
        offload=cfg.cpu_offload,
        activation_checkpointing=cfg.activation_checkpointing,
        compile=cfg.compile,
    )
    optimizer = build_optimizer(model.parameters(), cfg)  # [FSDP] after sharding: it steps the local shards
    scaler = loss_scaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed

    # resume or start afresh, save every --checkpoint-every steps, and on a preemption signal save and stop
    checkpoints = Checkpoints(cfg, model, [optimizer], scaler, sampler=sampler, steps=steps, log=log)
    if (start_step := checkpoints.start()) is None:
        return  # a finished run: nothing to train, nothing rewritten
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=env.is_main)
    recorder.track_memory(model.parameters(), optimizer)  # what this rank keeps between steps

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)
        test = evaluate(lambda x, _: model(x), data, part=env.rank, parts=env.world_size, device=env.device)
        recorder.eval(step, *test)
        model.train()

    # ---- training loop
    model.train()
    for step in recorder.steps():
        lr = lr_at(step, cfg, last_step=steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        with recorder.span("data"):
            indices = sampler.rank_batch(step, env.rank, env.world_size)  # this rank's slice of the global batch
            images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(zip(images.split(chunk_size), labels.split(chunk_size))):
            # On all but the last accumulation step, skip the gradient reduction: gradients accumulate locally
            # and only the last backward reduces their sum, once.
            is_last = i == cfg.grad_accum_steps - 1
            model.set_requires_gradient_sync(is_last)  # [FSDP] no reduce-scatter until the last accumulation step
            with recorder.span("forward"):  # [FSDP] each unit's all-gather shows inside it: "FSDP::all_gather"
                # divided by the accumulation steps, the summed gradients are those of the chunk mean
                loss = (loss_fn(model(x), y) + sum(moe.aux for moe in moes)) / cfg.grad_accum_steps
            with recorder.span("backward"):  # [FSDP] the reduce-scatter shows as "FSDP::post_backward_reduce"
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # [FSDP] Clip once per step, after the last backward, by the norm of the whole gradient: each rank
        # holds a shard of it, a DTensor sharded over the "shard" dim of the mesh, so the sums of squares are
        # added over that dim (hybrid's "replicate" rows hold the same shards again: not over those).
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, loss_scale=scaler.value)
        with recorder.span("optimizer"):
            scaler.step(optimizer, grad_norm)  # fp16: not if the gradients overflowed (the same on every rank)
        # loss_sum is this rank's mean loss; the mean over ranks is the mean over the whole global batch
        recorder.train(step, loss=global_mean(loss_sum), lr=lr, grad_norm=grad_norm, scaler=scaler)
        if recorder.eval_due(step):
            run_eval(step)
        if checkpoints.end_of_step(step, recorder):
            return  # stopped by a preemption signal, with this step's checkpoint

    run_eval(steps)
    # [FSDP] A plain model.pt for inference without a process group: every rank helps gather, rank 0 writes.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        save_model_file(full_state, cfg.out)  # torch.save to model.pt.tmp, then a rename: never half a file
    recorder.finish(files=["model.pt"], mesh=dict(zip(mesh.mesh_dim_names, mesh.shape)))


if __name__ == "__main__":
    run(main)
