"""Train BabyCNN with DistributedDataParallel (DDP).

    bash run_ddp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_ddp.py   # the same, by hand
    python train_ddp.py --max-steps 50                      # 1 process, no torchrun needed

Each rank keeps a full replica and runs its slice of the global batch; backward all-reduces the gradients
bucket by bucket, so identical optimizer steps keep the replicas identical (docs/ddp.md). Lines specific
to DDP are marked `# [DDP]`.
"""

from contextlib import nullcontext
from typing import Callable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, blank_batch, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.model import build_model
from common.recorder import RunRecorder
from common.runs import total_steps
from common.training import (
    autocast,
    build_optimizer,
    evaluate,
    global_mean,
    loss_fn,
    loss_scaler,
    lr_at,
    set_lr,
)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("ddp", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        train(cfg, env)
    finally:
        teardown_distributed()


def apply_ddp(
    model: nn.Module,
    *,
    device_ids: list[int] | None = None,
    comm_hook: Callable | None = None,
    compile: bool = False,
    init_sync: bool = True,
) -> DDP:
    """[DDP] The wrap. `device_ids`: the one GPU this process trains on (None on a CPU); `comm_hook`: a function
    that all-reduces a gradient bucket instead of DDP's own (register_comm_hook); `compile`: torch.compile the
    wrapped model; `init_sync=False`: no broadcast of rank 0's weights (python -m planner wraps fake tensors)."""
    # [DDP] Hooks all-reduce gradients during backward; .grad lives in DDP's buckets (one copy fewer).
    model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, init_sync=init_sync)
    if comm_hook is not None:
        model.register_comm_hook(None, comm_hook)  # [DDP] each bucket: comm_hook(None, bucket) -> a future
    if compile:
        # [DDP] Compile the wrapped model, as DDP's notes ask (docs/training.md): dynamo's DDPOptimizer then splits
        # the graph at DDP's bucket boundaries, so each bucket still all-reduces during backward.
        model.compile()
    return model


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    log(f"DDP | {env.world_size} ranks on {env.device.type}/{env.backend} | torch {torch.__version__}")

    # ---- data: every rank holds the whole data set; the sampler gives each rank its slice of each batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this rank runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    model = build_model(**cfg.model_kwargs(), **data.shape).to(env.device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters")
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    moes = model.moes() if cfg.experts else []  # --experts: BabyGPT's MoE layers, whose balance losses join the loss
    comm_hook = None
    if cfg.allreduce == "ring":
        from common.ring import ring_hook as comm_hook  # only with the flag: the ring all-reduce written out

    device_ids = [env.local_rank] if env.device.type == "cuda" else None
    model = apply_ddp(model, device_ids=device_ids, comm_hook=comm_hook, compile=cfg.compile)  # [DDP]
    optimizer = build_optimizer(model.parameters(), cfg)
    scaler = loss_scaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed

    def lay_out_buckets() -> None:
        # [DDP] After a process's first backward DDP lays its gradient buckets out again (docs/versions.md), in the
        # order the gradients became ready, and the layout decides the order in which gloo/NCCL sum each element.
        # A throwaway backward gives this process the layout the uninterrupted run has at this step, so it
        # repeats that run bit for bit; the checkpoint then overwrites weights, optimizer state and RNG.
        x = blank_batch(data, chunk_size, env.device)
        with autocast(cfg, env.device):  # the loop's shape and precision: --compile traces no other graph
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)  # DCP's load must find an optimizer that never saw a gradient

    # resume or start afresh, save every --checkpoint-every steps, and on a preemption signal save and stop
    checkpoints = Checkpoints(cfg, model, [optimizer], scaler, sampler=sampler, steps=steps, log=log)
    if (start_step := checkpoints.start(before_load=lay_out_buckets)) is None:
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
            with nullcontext() if is_last else model.no_sync():  # [DDP]
                with autocast(cfg, env.device), recorder.span("forward"):
                    # divided by the accumulation steps, the summed gradients are those of the chunk mean
                    loss = (loss_fn(model(x), y) + sum(moe.aux for moe in moes)) / cfg.grad_accum_steps
                # [DDP] the gradient all-reduce runs inside backward: "gloo:all_reduce" in the trace
                with recorder.span("backward"):
                    scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # [DDP] Clip once per step, after the last backward. The gradients are all-reduced by then: each rank
        # holds the whole model's gradient, so its own norm is the global one and needs no collective (an fp16
        # overflow on any rank is in every rank's sum: all skip the step).
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
    recorder.finish()


if __name__ == "__main__":
    run(main)
