"""Train BabyCNN with DistributedDataParallel (DDP).

    bash run_ddp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_ddp.py   # the same, by hand
    python train_ddp.py --max-steps 50                      # 1 process, no torchrun needed

Each rank keeps a full replica and runs its slice of the global batch; backward all-reduces the gradients
bucket by bucket, so identical optimizer steps keep the replicas identical (docs/ddp.md). Lines specific
to DDP are marked `# [DDP]`.
"""

import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import load_checkpoint, resume_point, save_checkpoint
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.compiling import compile_modules
from common.data import GlobalBatchSampler, load_dataset, to_device_batch
from common.distributed import RankLogger, run, seed_everything, setup_distributed, teardown_distributed
from common.metrics import MetricsWriter, measure_memory, write_run_json
from common.model import build_model
from common.profiling import StepProfiler
from common.runs import already_done, total_steps
from common.training import (
    autocast,
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
    cfg = parse_config("ddp", argv)
    env = setup_distributed(device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads)
    try:
        cfg.check(world_size=env.world_size)
        train(cfg, env)
    finally:
        teardown_distributed()


def train(cfg, env) -> None:
    log = RankLogger(env.is_main)
    log(f"DDP | {env.world_size} ranks on {env.device.type}/{env.backend} | torch {torch.__version__}")

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
    model = build_model(
        seed=cfg.seed,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        dropout=cfg.dropout,
    ).to(env.device)
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    # [DDP] Hooks all-reduce gradients during backward; .grad lives in DDP's buckets (one copy fewer).
    model = DDP(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None, gradient_as_bucket_view=True)
    if cfg.compile:
        # [DDP] Compile the wrapped model, as DDP's notes ask (docs/training.md): dynamo's DDPOptimizer then
        # splits the graph at DDP's bucket boundaries, so each bucket still all-reduces during backward.
        compile_modules([model], env.device)
    optimizer = build_optimizer(model.parameters(), cfg)

    start_step = 0
    if path := resume_point(cfg, log=log):  # (a new run moves a previous one in --out aside instead)
        # [DDP] After a process's first backward DDP lays its gradient buckets out again, in the order the
        # gradients became ready, and the layout decides the order in which gloo/NCCL sum each element. A
        # throwaway backward gives this process the layout the uninterrupted run has at this step, so it repeats
        # that run bit for bit; the checkpoint then overwrites weights, optimizer state and RNG.
        x = torch.zeros(micro_batch_size, data.in_channels, data.image_size, data.image_size, device=env.device)
        with autocast(cfg, env.device):  # the loop's shape and precision: --compile traces no other graph
            model(x).sum().backward()
        model.zero_grad(set_to_none=True)  # DCP's load must find an optimizer that never saw a gradient
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
            with nullcontext() if is_last else model.no_sync():  # [DDP]
                with autocast(cfg, env.device), profiler.span("forward"):
                    # divided by the accumulation steps, the summed gradients are those of the chunk mean
                    loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps
                # [DDP] the gradient all-reduce runs inside backward: "gloo:all_reduce" in the trace
                with profiler.span("backward"):
                    loss.backward()
            loss_sum += loss.detach()
        # [DDP] Clip once per step, after the last backward. The gradients are all-reduced by then: each rank
        # holds the whole model's gradient, so its own norm is the global one and needs no collective.
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm)
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
    profile = profiler.report()
    run_eval(steps)
    if env.is_main:
        final = metrics.final()
        write_run_json(cfg.out, **describe_run(cfg, env, profile=profile), final=final, memory={"per_rank": memory})
        log(
            f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
            f"{final['wall_time_s']:.1f} s | {cfg.out}/metrics.jsonl, {cfg.out}/run.json"
        )
    metrics.close()


if __name__ == "__main__":
    run(main)
