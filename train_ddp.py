"""Train BabyCNN with DistributedDataParallel (DDP).

    bash run_ddp.sh                                         # 4 processes: GPUs + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 train_ddp.py   # the same, by hand
    python train_ddp.py --max-steps 50                      # 1 process, no torchrun needed

DDP keeps a full replica of the model on every rank. Each rank runs forward and backward on its own slice
of the global batch; during backward DDP all-reduces (averages) the gradients bucket by bucket, overlapping
communication with computation. After `backward()` every replica holds the same averaged gradient, so the
identical optimizer steps keep the replicas identical. Lines specific to DDP are marked `# [DDP]`.
"""

import time
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from common.checkpoint import load_checkpoint, resume_point, save_checkpoint
from common.cli import parse_config
from common.data import GlobalBatchSampler, load_dataset, to_device_batch
from common.ddp_hook import allreduce_each_gradient
from common.distributed import RankLogger, run, seed_everything, setup_distributed, teardown_distributed
from common.metrics import MetricsWriter, measure_memory, write_run_json
from common.model import build_model
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
    total_steps,
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
    log(f"DDP | {env.world_size} process(es) on {env.device.type} ({env.backend}) | torch {torch.__version__}")

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
    # [DDP] Wrap the replica. DDP broadcasts rank 0's weights once (they already agree) and registers the
    # hooks that all-reduce gradients during backward. gradient_as_bucket_view: the .grad tensors live in
    # DDP's communication buckets instead of beside them, which saves one copy of the gradients.
    model = DDP(
        model,
        device_ids=[env.local_rank] if env.device.type == "cuda" else None,
        gradient_as_bucket_view=True,
    )
    # [DDP] One all-reduce per parameter instead of per bucket: DDP re-lays its buckets out after a process's
    # first step, which changes gloo's summation order; per parameter, a resumed run repeats the uninterrupted
    # one bit for bit. Costs 1.2-1.3x step time here (docs/checkpoints.md has the measurement).
    model.register_comm_hook(None, allreduce_each_gradient)
    optimizer = build_optimizer(model.parameters(), cfg)

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
            # [DDP] no_sync: accumulate gradients locally on all but the last micro-step; the last backward
            # all-reduces the accumulated sum once, instead of once per micro-step.
            is_last = i == cfg.grad_accum_steps - 1
            with nullcontext() if is_last else model.no_sync():
                with autocast(cfg, env.device):
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
    run_eval(steps)
    if env.is_main:
        final = metrics.final()
        write_run_json(cfg.out, **describe_run(cfg, env), final=final, memory={"per_rank": memory})
        log(
            f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
            f"{final['wall_time_s']:.1f} s | {cfg.out}/metrics.jsonl, {cfg.out}/run.json"
        )
    metrics.close()


if __name__ == "__main__":
    run(main)
