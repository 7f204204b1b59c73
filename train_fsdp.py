"""Train BabyCNN with FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

    bash run_fsdp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_fsdp.py   # the same, by hand
    python train_fsdp.py --max-steps 50                      # 1 process, no torchrun needed

Each rank keeps a shard of every parameter, gradient and optimizer state; a unit's shards are all-gathered
before it runs and its gradients reduce-scattered after its backward (docs/fsdp.md). Lines specific to FSDP
are marked `# [FSDP]`.
"""

import os
import time

import torch
import torch.nn.functional as F
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.checkpoint import load_checkpoint, resume_point, save_checkpoint
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.compiling import compile_modules
from common.data import GlobalBatchSampler, load_dataset, to_device_batch
from common.distributed import RankLogger, run, seed_everything, setup_distributed, teardown_distributed
from common.metrics import MetricsWriter, measure_memory, write_run_json
from common.model import blocks, build_model
from common.profiling import StepProfiler
from common.runs import already_done, total_steps
from common.training import (
    build_optimizer,
    check_finite,
    describe_run,
    evaluate,
    gather_memory,
    global_mean,
    lr_at,
    set_lr,
)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("fsdp", argv)
    env = setup_distributed(device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads)
    try:
        cfg.check(world_size=env.world_size)
        train(cfg, env)
    finally:
        teardown_distributed()


def train(cfg, env) -> None:
    log = RankLogger(env.is_main)
    log(f"FSDP {cfg.sharding} | {env.world_size} ranks on {env.device.type}/{env.backend} | torch {torch.__version__}")

    # ---- data: every rank holds the whole data set; the sampler gives each rank its slice of each batch
    data = load_dataset(
        cfg.dataset,
        data_dir=cfg.data_dir,
        seed=cfg.seed,
        train_size=cfg.train_size,
        test_size=cfg.test_size,
        download=env.world_size == 1,
    )
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    micro_batch_size = cfg.batch_size // env.world_size // cfg.grad_accum_steps
    log(
        f"{cfg.dataset}: {len(data.train)} train / {len(data.test)} test images | global batch {cfg.batch_size} "
        f"= {env.world_size} ranks x {cfg.grad_accum_steps} accumulation steps x {micro_batch_size} | {steps} steps"
    )
    if sampler.left_out_per_epoch:
        log(
            f"note: {sampler.left_out_per_epoch} samples per epoch do not fill a global batch and sit out "
            f"that epoch (different ones each epoch)"
        )

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    # [FSDP] Built whole on the CPU, then sharded (fully_shard moves each shard to the device): DDP's initial
    # weights, so the curves compare. Big models use the meta device instead (docs/fsdp.md).
    model = build_model(
        seed=cfg.seed,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        dropout=cfg.dropout,
    )
    model_blocks = blocks(model)  # the units to shard, taken before a checkpoint wrapper hides the layers
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    if cfg.activation_checkpointing:
        # [FSDP] Keep only the input for backward and recompute the activations, at the cost of a second
        # forward; the whole flat model is the span that pays (docs/fsdp.md). Checkpoint keys stay conv1.weight.
        model = checkpoint_wrapper(model)
    # [FSDP] The ranks of a "shard" row split every parameter; "replicate" rows hold the same shards and
    # all-reduce their gradients. hybrid: 2 rows of world/2 ranks; none: shards of one rank (NO_SHARD).
    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": env.world_size}[cfg.sharding]
    mesh = (
        init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
        if replicas == 1
        else init_device_mesh(
            env.device.type, (replicas, env.world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    )
    # [FSDP] Free gathered parameters after forward (full; None is FSDP's default) or keep them for backward
    # (grad-op). bf16: compute in bf16, fp32 shards and gradient reduction (replaces DDP's autocast).
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    shard_options = dict(
        mesh=mesh,
        reshard_after_forward=False if cfg.sharding == "grad-op" else None,
        mp_policy=bf16 if cfg.precision == "bf16" else MixedPrecisionPolicy(),
        offload_policy=offload if cfg.cpu_offload else OffloadPolicy(),
    )
    # [FSDP] Each fully_shard call makes a unit (an all-gather before it, a reduce-scatter after its backward):
    # the root alone (fewest collectives), or each block then the root (full parameters a block at a time;
    # the last block keeps its parameters for its backward, which follows at once).
    if cfg.compile:
        # [FSDP] Compile before sharding. FSDP2's hooks (all-gather before a unit, reduce-scatter after its
        # backward) are marked for dynamo to leave out, so the graph breaks at each unit's boundary: a graph
        # per unit, with the collectives run eagerly between them, as torchtitan does per block.
        compile_modules([model], env.device)
    if cfg.shard_units == "blocks":
        *first, last = model_blocks.values()
        for layers in first:
            fully_shard(layers, **shard_options)
        fully_shard(last, **{**shard_options, "reshard_after_forward": False})
    fully_shard(model, **shard_options)
    optimizer = build_optimizer(model.parameters(), cfg)  # [FSDP] after sharding: it steps the local shards

    start_step = 0
    if path := resume_point(cfg, log=log):  # (a new run moves a previous one in --out aside instead)
        start_step = load_checkpoint(path, model=model, optimizers=[optimizer])
        log(f"resumed from {path} (step {start_step})")
    if start_step >= steps:  # a finished run: nothing to train, nothing to rewrite
        log(already_done(cfg.out, start_step, steps))
        return
    metrics = MetricsWriter(
        cfg.out,
        enabled=env.is_main,
        total_steps=steps,
        log_every=cfg.log_every,
        start_step=start_step,
        tensorboard=cfg.tensorboard,
    )

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)
        test_loss, test_accuracy = evaluate(
            model, data.test, data, rank=env.rank, world_size=env.world_size, device=env.device
        )
        model.train()
        metrics.eval(step, test_loss=test_loss, test_accuracy=test_accuracy)

    # --profile-steps: torch.profiler and named spans over those steps only; without it, no-ops
    profiler = StepProfiler(
        cfg.profile_steps, out_dir=cfg.out, rank=env.rank, device=env.device, memory=cfg.memory_snapshot
    )

    # ---- training loop
    model.train()
    for step in range(start_step + 1, steps + 1):
        started = time.perf_counter()
        profiler.step_start(step)
        lr = lr_at(step, cfg, last_step=steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        with profiler.span("data"):
            indices = sampler.rank_batch(step, env.rank, env.world_size)  # this rank's slice of the global batch
            images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(zip(images.split(micro_batch_size), labels.split(micro_batch_size))):
            # On all but the last micro-step, skip the gradient reduction: gradients accumulate locally
            # and only the last backward reduces their sum, once.
            is_last = i == cfg.grad_accum_steps - 1
            model.set_requires_gradient_sync(is_last)  # [FSDP] no reduce-scatter until the last micro-step
            with profiler.span("forward"):  # [FSDP] each unit's all-gather shows inside it: "FSDP::all_gather"
                # divided by the accumulation steps, the summed gradients are those of the chunk mean
                loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps
            with profiler.span("backward"):  # [FSDP] the reduce-scatter shows as "FSDP::post_backward_reduce"
                loss.backward()
            loss_sum += loss.detach()
        # [FSDP] Clip once per step, after the last backward, by the norm of the whole gradient: each rank
        # holds a shard of it, so the sums of squares are added over the "shard" dim of the mesh (hybrid's
        # "replicate" rows hold the same shards again; none's shard rows are one rank each).
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, groups=[mesh.get_group("shard")])
        with profiler.span("optimizer"):
            optimizer.step()

        # loss_sum is this rank's mean loss; the mean over ranks is the mean over the whole global batch
        loss_value = global_mean(loss_sum)
        check_finite(loss_value, step)
        profiler.step_end(step)
        metrics.train(
            step,
            loss=loss_value,
            lr=lr,
            grad_norm=grad_norm,
            samples=cfg.batch_size,
            step_time_s=time.perf_counter() - started,
        )
        if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
            run_eval(step)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, step, model=model, optimizers=[optimizer], steps_per_epoch=sampler.steps_per_epoch)

    memory = gather_memory(measure_memory(model.parameters(), optimizer, env.device), env.rank)
    # [FSDP] The theory next to the measurement: per parameter 4 + 4 bytes (fp32 weight, gradient) and the
    # optimizer state (AdamW 8, SGD 4), divided by the ranks sharing it (what is not counted: docs/fsdp.md).
    n_params, shards = sum(p.numel() for p in model.parameters()), mesh["shard"].size()
    per_param = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8 if cfg.optimizer == "adamw" else 4}
    theory = {"parameters": n_params, "shards": shards, **{k: v * n_params / shards for k, v in per_param.items()}}
    profile = profiler.report()
    run_eval(steps)
    # [FSDP] A plain model.pt for inference without a process group: every rank helps gather, rank 0 writes.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        torch.save(full_state, os.path.join(cfg.out, "model.pt.tmp"))
        os.replace(os.path.join(cfg.out, "model.pt.tmp"), os.path.join(cfg.out, "model.pt"))  # never half a file
        final = metrics.final()
        run_info = describe_run(cfg, env, mesh=dict(zip(mesh.mesh_dim_names, mesh.shape)), profile=profile)
        write_run_json(cfg.out, **run_info, final=final, memory={"per_rank": memory, "theory": theory})
        log(
            f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
            f"{final['wall_time_s']:.1f} s | {cfg.out}/metrics.jsonl, {cfg.out}/run.json, {cfg.out}/model.pt"
        )
    metrics.close()


if __name__ == "__main__":
    run(main)
