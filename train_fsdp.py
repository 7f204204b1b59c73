"""Train BabyCNN with FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

    bash run_fsdp.sh                                          # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_fsdp.py    # the same, by hand
    python train_fsdp.py --max-steps 50                       # 1 process, no torchrun needed
    bash run_fsdp.sh --sharding hybrid --precision bf16       # HSDP with bf16 compute (see --help)

FSDP keeps on each rank only a shard of every parameter, of its gradient and of its optimizer state. Before
a unit runs, its shards are all-gathered into the full parameters; after its backward, the gradients are
reduce-scattered, so each rank holds the averaged gradient of its own shard and steps the optimizer on that
shard alone. `--sharding` decides over which ranks (full, grad-op, hybrid, none), `--shard-units` what a
unit is (the whole model, or each block: see the README). Lines specific to FSDP are marked `# [FSDP]`.
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
from common.data import GlobalBatchSampler, load_dataset, to_device_batch
from common.distributed import RankLogger, run, seed_everything, setup_distributed, teardown_distributed
from common.metrics import MetricsWriter, measure_memory, write_run_json
from common.model import blocks, build_model
from common.training import (
    build_optimizer,
    check_finite,
    describe_run,
    evaluate,
    gather_memory,
    global_mean,
    lr_at,
    set_lr,
    total_steps,
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
    log(
        f"FSDP ({cfg.sharding}) | {env.world_size} process(es) on {env.device.type} ({env.backend}) | "
        f"torch {torch.__version__}"
    )

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
    # [FSDP] Built whole on the CPU, then sharded; fully_shard moves each rank's shard to the mesh's device.
    # Not on the meta device (the way for models too big for one device: shard empty tensors, then initialise
    # each shard), because shards initialised separately would not be DDP's weights, and the curves would
    # no longer be comparable. BabyCNN's 1.3M parameters are cheap to build whole.
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
        # [FSDP] Keep only the model's input for backward and recompute the activations there, at the cost
        # of a second forward. BabyCNN is one flat Sequential, so the whole model is the span that pays: a
        # checkpointed single layer still stores its input, which is about what it saves. (In a transformer
        # you wrap each block.) The wrapper's name never reaches a state dict: checkpoints keep conv1.weight.
        model = checkpoint_wrapper(model)
    # [FSDP] The device mesh: the ranks of a "shard" row split every parameter between them; the rows of the
    # "replicate" dim hold the same shards and all-reduce their gradients. full, grad-op: one row of all
    # ranks; hybrid: 2 rows of world/2 ranks (on two machines: shard within each, replicate across them);
    # none: a row per rank, shards of size 1 (how FSDP2 spells NO_SHARD: every rank keeps everything).
    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": env.world_size}[cfg.sharding]
    mesh = (
        init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
        if replicas == 1
        else init_device_mesh(
            env.device.type, (replicas, env.world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    )
    # [FSDP] reshard_after_forward: free a unit's gathered parameters after its forward and gather them again
    # for its backward (full, ZeRO-3), or keep them until then (grad-op, ZeRO-2: more memory, fewer gathers).
    # None is FSDP's own default: True for every unit but the root, whose backward comes right after forward.
    # bf16: the gathered parameters are cast to bf16 for compute, the fp32 shards stay what the optimizer
    # updates, gradients are reduced in fp32 (a sum of many bf16 numbers loses digits), and the output comes
    # back as fp32 for the loss; this replaces DDP's autocast. CPU offload: shards, gradients and optimizer
    # state live in CPU memory and the optimizer steps there; pinned memory (for asynchronous copies to the
    # GPU) exists only with a GPU.
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    shard_options = dict(
        mesh=mesh,
        reshard_after_forward=False if cfg.sharding == "grad-op" else None,
        mp_policy=bf16 if cfg.precision == "bf16" else MixedPrecisionPolicy(),
        offload_policy=offload if cfg.cpu_offload else OffloadPolicy(),
    )
    # [FSDP] The units: each fully_shard call makes one, with one all-gather of its parameters before it runs
    # and one reduce-scatter of its gradients after its backward. --shard-units model (default): the root
    # alone, one unit for BabyCNN's 1.3M parameters (FSDP1's size-based wrap policy leaves modules under
    # 100M parameters to their parent): the fewest collectives, one all-gather and one reduce-scatter per step.
    # --shard-units blocks: bottom-up, each block (common/model.py BLOCKS: features, classifier) first, then
    # the root, so the full parameters exist a block at a time: the pattern of a model too big to gather
    # whole (in a transformer, each layer is a block; a list of modules is one unit). The last block keeps
    # its parameters from forward to its backward, which comes right after: one all-gather fewer per step.
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
        log(f"{cfg.out}: already at step {start_step} of {steps}; nothing to train (raise --max-steps or --epochs)")
        return
    metrics = MetricsWriter(
        cfg.out, enabled=env.is_main, total_steps=steps, log_every=cfg.log_every, start_step=start_step
    )

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)
        test_loss, test_accuracy = evaluate(
            model, data.test, data, rank=env.rank, world_size=env.world_size, device=env.device
        )
        model.train()
        metrics.eval(step, test_loss=test_loss, test_accuracy=test_accuracy)

    # ---- training loop
    model.train()
    for step in range(start_step + 1, steps + 1):
        started = time.perf_counter()
        lr = lr_at(step, cfg)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        indices = sampler.rank_batch(step, env.rank, env.world_size)  # this rank's slice of the global batch
        images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(zip(images.split(micro_batch_size), labels.split(micro_batch_size))):
            # [FSDP] On all but the last micro-step, skip the reduce-scatter (and HSDP's all-reduce): gradients
            # accumulate unsharded on each rank, and only the last backward reduces their sum, once.
            is_last = i == cfg.grad_accum_steps - 1
            model.set_requires_gradient_sync(is_last)
            # divided by the accumulation steps, the summed gradients are those of the chunk mean
            loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps
            loss.backward()
            loss_sum += loss.detach()
        optimizer.step()

        # loss_sum is this rank's mean loss; the mean over ranks is the mean over the whole global batch
        loss_value = global_mean(loss_sum)
        check_finite(loss_value, step)
        metrics.train(step, loss=loss_value, lr=lr, samples=cfg.batch_size, step_time_s=time.perf_counter() - started)
        if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
            run_eval(step)
        if cfg.checkpoint_every and step % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, step, model=model, optimizers=[optimizer], steps_per_epoch=sampler.steps_per_epoch)

    memory = gather_memory(measure_memory(model.parameters(), optimizer, env.device), env.rank)
    # [FSDP] The theory next to the measurement: fp32 parameter and gradient (4 + 4 bytes) and the optimizer's
    # fp32 state (AdamW's two moments: 8; SGD's momentum: 4) per parameter, divided by the ranks that share
    # it. Not counted: AdamW's step counters, the padding of uneven shards, and the gathered parameters and
    # unsharded gradients that exist only while a layer runs forward or backward.
    n_params, shards = sum(p.numel() for p in model.parameters()), mesh["shard"].size()
    per_param = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8 if cfg.optimizer == "adamw" else 4}
    theory = {"parameters": n_params, "shards": shards, **{k: v * n_params / shards for k, v in per_param.items()}}
    run_eval(steps)
    # [FSDP] A plain full-state model.pt for inference without a process group: every rank takes part in
    # gathering the shards, rank 0 alone receives and writes them (keys as in BabyCNN: conv1.weight, ...).
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        torch.save(full_state, os.path.join(cfg.out, "model.pt.tmp"))
        os.replace(os.path.join(cfg.out, "model.pt.tmp"), os.path.join(cfg.out, "model.pt"))  # never half a file
        final = metrics.final()
        write_run_json(
            cfg.out,
            **describe_run(cfg, env, mesh=dict(zip(mesh.mesh_dim_names, mesh.shape))),
            final=final,
            memory={"per_rank": memory, "theory": theory},
        )
        log(
            f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
            f"{final['wall_time_s']:.1f} s | {cfg.out}/metrics.jsonl, {cfg.out}/run.json, {cfg.out}/model.pt"
        )
    metrics.close()


if __name__ == "__main__":
    run(main)
