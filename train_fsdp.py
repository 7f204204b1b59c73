"""Train BabyCNN with FSDP2 (`fully_shard`): parameters, gradients and optimizer state sharded across ranks.

    bash run_fsdp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_fsdp.py   # the same, by hand
    python train_fsdp.py --max-steps 50                      # 1 process, no torchrun needed

Each rank keeps a shard of every parameter, gradient and optimizer state; a unit's shards are all-gathered
before it runs and its gradients reduce-scattered after its backward (docs/fsdp.md). Lines specific to FSDP
are marked `# [FSDP]`.
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

from common.checkpoint import (
    checkpoint_to_resume,
    load_checkpoint,
    save_checkpoint,
    save_model_file,
    set_aside_previous_run,
)
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
from common.model_sizes import state_bytes_theory
from common.recorder import RunRecorder
from common.runs import already_done, total_steps
from common.traffic import Traffic, add, padded_shard
from common.training import LossScaler, build_optimizer, evaluate, global_mean, low_precision, lr_at, set_lr


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


def fsdp_units(model: BabyCNN) -> dict[str, list[nn.Module]]:
    """[FSDP] The units of `--shard-units blocks`, by the layers each gathers: the features, then the classifier,
    whole for baby, a layer at a time for the larger sizes. baby's fc1 holds 93% of its parameters, so layer by
    layer would gather almost the same peak of full weights while paying 2.5x the collectives (hence also the
    default, the whole model as one unit: --shard-units model)."""
    names = list(model._modules)
    cuts = [0, names.index("flatten"), *(i for i, name in enumerate(names) if name.startswith("hidden"))]
    named = {"features": names[: cuts[1]]}
    if len(cuts) == 2:
        named["classifier"] = names[cuts[1] :]
    else:
        named["fc1"] = names[cuts[1] : cuts[2]]
        for start, end in zip(cuts[2:], [*cuts[3:], len(names)]):
            named[names[start]] = names[start:end]  # hiddenK and its ReLU (the last also takes fc2)
    return {name: [model._modules[layer] for layer in layers] for name, layers in named.items()}


def fsdp_mesh(cfg: Config, env: DistEnv) -> DeviceMesh:
    """[FSDP] The device mesh: who holds which shard (made outside the planner's fake tensors: it communicates)."""
    # [FSDP] The ranks of a "shard" row split every parameter; "replicate" rows hold the same shards and
    # all-reduce their gradients. hybrid: 2 rows of world/2 ranks; none: shards of one rank (NO_SHARD).
    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": env.world_size}[cfg.sharding]
    return (
        init_device_mesh(env.device.type, (env.world_size,), mesh_dim_names=("shard",))
        if replicas == 1
        else init_device_mesh(
            env.device.type, (replicas, env.world_size // replicas), mesh_dim_names=("replicate", "shard")
        )
    )


def apply_fsdp(model: BabyCNN, mesh: DeviceMesh, cfg: Config, env: DistEnv) -> nn.Module:
    """[FSDP] The wrap: the policies and a fully_shard call per unit, over `mesh`. Returns the model to train (in
    a checkpoint wrapper with --activation-checkpointing). python -m planner shards with it too."""
    units = fsdp_units(model)  # taken before a checkpoint wrapper hides the layers
    if cfg.activation_checkpointing:
        # [FSDP] Keep only the input for backward and recompute the activations, at the cost of a second
        # forward; the whole flat model is the span that pays (docs/fsdp.md). Checkpoint keys stay conv1.weight.
        model = checkpoint_wrapper(model)
    # [FSDP] Free gathered parameters after forward (full; None is FSDP's default) or keep them for backward
    # (grad-op). bf16 or fp16: compute in it, fp32 shards and gradient reduction (replaces DDP's autocast).
    low = low_precision(cfg)
    mixed = MixedPrecisionPolicy(param_dtype=low, reduce_dtype=torch.float32, output_dtype=torch.float32)
    offload = CPUOffloadPolicy(pin_memory=env.device.type == "cuda")
    shard_options = dict(
        mesh=mesh,
        reshard_after_forward=False if cfg.sharding == "grad-op" else None,
        mp_policy=mixed if low else MixedPrecisionPolicy(),
        offload_policy=offload if cfg.cpu_offload else OffloadPolicy(),
    )
    # [FSDP] Each fully_shard call makes a unit (an all-gather before it, a reduce-scatter after its backward):
    # the root alone (fewest collectives), or each block then the root (full parameters a block at a time;
    # the last block keeps its parameters for its backward, which follows at once).
    if cfg.compile:
        from common.compiling import compile_modules  # only with the flag, like every optional feature

        # [FSDP] Compile before sharding. FSDP2's hooks (all-gather before a unit, reduce-scatter after its
        # backward) are marked for dynamo to leave out, so the graph breaks at each unit's boundary: a graph
        # per unit, with the collectives run eagerly between them, as torchtitan does per block.
        compile_modules([model], env.device)
    if cfg.shard_units == "blocks":
        *first, last = units.values()
        for layers in first:
            fully_shard(layers, **shard_options)
        fully_shard(last, **{**shard_options, "reshard_after_forward": False})
    fully_shard(model, **shard_options)
    return model


def fsdp_traffic(model: BabyCNN, mesh: DeviceMesh, cfg: Config) -> Traffic:
    """[FSDP] What each rank moves per step (run.json "traffic"; docs/communication.md), from the units as
    apply_fsdp makes them: each unit's parameters all-gathered before its forward (each accumulation step) and,
    if it was resharded after forward, again before its backward; its gradients reduce-scattered once, and with
    hybrid the shard all-reduced over the replicas. Shards are padded to equal rows (`padded_shard`)."""
    shard = mesh["shard"].size()
    replicas = mesh["replicate"].size() if "replicate" in (mesh.mesh_dim_names or ()) else 1
    blocks = list(fsdp_units(model).values()) if cfg.shard_units == "blocks" else []
    in_blocks = {id(p) for layers in blocks for layer in layers for p in layer.parameters()}
    units = [[p for layer in layers for p in layer.parameters()] for layers in blocks]
    units.append([p for p in model.parameters() if id(p) not in in_blocks])  # the root: what no block holds
    gather_itemsize = (low_precision(cfg) or torch.float32).itemsize  # (reduced in fp32 either way)
    traffic: Traffic = {}
    for i, params in enumerate(units):
        elements = shard * sum(padded_shard(tuple(p.shape), shard) for p in params)
        if not elements:
            continue
        # resharded after forward: every unit but the last block and the root, unless grad-op or none keep them
        regathered = cfg.sharding in ("full", "hybrid") and i < len(units) - 2
        gathers = cfg.grad_accum_steps * (2 if regathered else 1)
        add(traffic, "all_gather", elements=elements, itemsize=gather_itemsize, ranks=shard, times=gathers)
        add(traffic, "reduce_scatter", elements=elements, itemsize=4, ranks=shard)
        if replicas > 1:
            add(traffic, "all_reduce", elements=elements // shard, itemsize=4, ranks=replicas)
    return traffic


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
    model = build_model(
        size=cfg.model_size,
        seed=cfg.seed,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        dropout=cfg.dropout,
    )
    n_params = sum(p.numel() for p in model.parameters())
    log(f"BabyCNN {cfg.model_size}: {n_params:,} parameters")
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    mesh = fsdp_mesh(cfg, env)  # [FSDP]
    traffic = fsdp_traffic(model, mesh, cfg)  # [FSDP] (before sharding: the units' whole parameters)
    model = apply_fsdp(model, mesh, cfg, env)  # [FSDP]
    optimizer = build_optimizer(model.parameters(), cfg)  # [FSDP] after sharding: it steps the local shards
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
                loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps
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
    # [FSDP] A plain model.pt for inference without a process group: every rank helps gather, rank 0 writes.
    full_state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if env.is_main:
        save_model_file(full_state, cfg.out)  # torch.save to model.pt.tmp, then a rename: never half a file
    # [FSDP] The theory next to the measurement: the textbook's bytes per parameter, divided by the shards.
    theory = state_bytes_theory(n_params, shards=mesh["shard"].size(), optimizer=cfg.optimizer)
    mesh_shape = dict(zip(mesh.mesh_dim_names, mesh.shape))
    recorder.finish(traffic=traffic, memory_theory=theory, files=["model.pt"], mesh=mesh_shape)


if __name__ == "__main__":
    run(main)
