"""Train BabyCNN with pipeline parallelism (torch.distributed.pipelining).

    bash run_pippy.sh                                                  # 4 processes = 4 stages, 1F1B
    bash run_pippy.sh --schedule interleaved-1f1b --stages-per-rank 2  # 8 stages, 2 per rank
    bash run_pippy.sh --schedule zbv --stages-per-rank 2               # zero bubble, stages in a V
    bash run_pippy.sh --dp 2                                           # 2 replicas x 2 stages (2-D mesh)
    torchrun --standalone --nproc-per-node 4 train_pippy.py            # the same as the first, by hand

The model is cut into consecutive stages, each rank holds one or more, and each replica's share of the
global batch streams through them in micro-batches in the order the schedule decides; the idle time (the
bubble) is measured into run.json and bubble.jsonl (docs/pipeline.md). Lines specific to pipelining are
marked `# [PP]`.
"""

import time
from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage

from common.checkpoint import load_checkpoint, resume_point, save_checkpoint
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.compiling import compile_stages
from common.data import GlobalBatchSampler, load_dataset, to_device_batch
from common.distributed import RankLogger, run, seed_everything, setup_distributed, teardown_distributed
from common.metrics import MetricsWriter, measure_memory, write_run_json
from common.model import build_model, split_model
from common.pipeline import (
    BubbleMeter,
    bubble_summary,
    build_schedule,
    describe_cut,
    evaluate_pipeline,
    forward_stage_by_stage,
    stage_indices,
    stage_output_shapes,
    stage_owner,
)
from common.pipeline_actions import ActionClock
from common.profiling import StepProfiler
from common.runs import already_done, total_steps
from common.training import (
    autocast,
    build_optimizer,
    check_finite,
    describe_run,
    gather_memory,
    lr_at,
    set_lr,
)


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("pippy", argv)
    env = setup_distributed(device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads)
    try:
        cfg.check(world_size=env.world_size)
        train(cfg, env)
    finally:
        teardown_distributed()


def train(cfg, env) -> None:
    # [PP] A 2-D mesh: "dp" indexes the pipeline replicas, "pp" the ranks of one pipeline
    # (rank = replica * pp_size + pp_rank). Passing it explicitly lets the same code run on GPUs.
    pp_size = env.world_size // cfg.dp
    n_stages = pp_size * cfg.stages_per_rank
    mesh = init_device_mesh(env.device.type, (cfg.dp, pp_size), mesh_dim_names=("dp", "pp"))
    replica, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    my_stages = stage_indices(cfg.schedule, pp_rank, pp_size, cfg.stages_per_rank)
    owner = lambda stage: stage_owner(cfg.schedule, stage, pp_size)  # the pipeline rank holding a stage
    holds_first, holds_last = 0 in my_stages, n_stages - 1 in my_stages
    # The loss exists only on the last stage: replica 0's last-stage rank logs and writes run.json. That
    # is pipeline rank p-1, except with the V schedules, which put the last stage back on rank 0.
    is_logger = holds_last and replica == 0
    log = RankLogger(is_logger)
    log(
        f"pipeline | {env.world_size} processes = {cfg.dp} replica(s) x {pp_size} pipeline ranks on "
        f"{env.device.type} ({env.backend}) | {cfg.schedule}, {n_stages} stages | torch {torch.__version__}"
    )

    # ---- data: every rank holds the whole data set; a replica takes its slice of each global batch
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
    chunk = cfg.batch_size // cfg.dp // cfg.grad_accum_steps  # what one schedule.step() consumes
    log(
        f"{cfg.dataset}: {len(data.train)} train / {len(data.test)} test images | global batch {cfg.batch_size} = "
        f"{cfg.dp} replicas x {cfg.grad_accum_steps} accumulation steps x {cfg.n_microbatches} micro-batches x "
        f"{chunk // cfg.n_microbatches} | {steps} steps"
    )

    # ---- model: build the whole model on every rank (the same initial weights as DDP for the same
    # seed), cut it, and keep only this rank's stages.
    model = build_model(
        seed=cfg.seed,
        in_channels=data.in_channels,
        image_size=data.image_size,
        num_classes=data.num_classes,
        dropout=cfg.dropout,
    )
    # [PP] The explicit cut (STAGE_STARTS in common/model.py). `flatten` always opens a stage: its output is
    # a view, and the zero-bubble schedules fail on a stage whose output is a view.
    pieces = split_model(model, n_stages)
    log("\n".join(describe_cut(pieces, owner)))
    shapes = stage_output_shapes(pieces, data.train.images[:1].float())
    modules = {i: pieces[i].to(env.device) for i in my_stages}
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    if cfg.compile:
        # [PP] Each stage module is compiled on its own: the schedule calls it per micro-batch, and the
        # send/recv between stages stays outside the graphs.
        compile_stages(list(modules.values()), env.device)
    if cfg.dp > 1:
        for module in modules.values():
            if list(module.parameters()):  # a parameter-free stage has nothing to shard
                # [PP] FSDP2 across the replicas holding this stage. Not resharding after forward: the
                # schedule runs several micro-batch forwards per step; the pipeline reshards after the
                # step's last backward (and reduce-scatters the gradients then, once).
                fully_shard(module, mesh=mesh["dp"], reshard_after_forward=False)
    # [PP] One PipelineStage per stage this rank holds; activation shapes are inferred at the first step.
    stages = [PipelineStage(modules[i], i, n_stages, env.device, group=mesh.get_group("pp")) for i in my_stages]

    # [PP] The loss of a micro-batch is its mean divided by the number of micro-batches (and accumulation
    # steps): the gradients summed over the step are then those of the mean over this replica's batch,
    # like DDP's, and the losses the schedule returns add up to that mean. (Hence scale_grads=False.)
    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float(), labels) / (cfg.n_microbatches * cfg.grad_accum_steps)

    schedule = build_schedule(cfg.schedule, stages, cfg.n_microbatches, loss_fn)  # [PP]

    # This rank's layers under their own names (conv1.weight, ...), as in the whole model: the module
    # that optimizer and checkpoints see, so a checkpoint of any strategy loads into any other.
    local_model = nn.Sequential(
        OrderedDict((name, layer) for i in sorted(modules) for name, layer in modules[i].named_children())
    )
    params = list(local_model.parameters())
    # A rank whose stages have no parameters (pooling, activations) has no optimizer at all.
    optimizer = build_optimizer(params, cfg) if params else None
    optimizers = [optimizer] if optimizer else []

    start_step = 0
    if path := resume_point(cfg, log=log):  # (a new run moves a previous one in --out aside instead)
        start_step = load_checkpoint(path, model=local_model, optimizers=optimizers)
        log(f"resumed from {path} (step {start_step})")
    if start_step >= steps:  # a finished run: nothing to train, nothing to rewrite
        log(already_done(cfg.out, start_step, steps))
        return
    metrics = MetricsWriter(
        cfg.out,
        enabled=is_logger,
        total_steps=steps,
        log_every=cfg.log_every,
        start_step=start_step,
        tensorboard=cfg.tensorboard,
    )
    meter = BubbleMeter(stages, env.device)  # [PP] time in stage compute; the rest of a step is the bubble

    # [PP] Where two consecutive stages share a rank (always in a V; any pipeline of one rank), the
    # schedule hands activations over locally, and that path fails forward-only on this torch
    # (schedule.eval(): "can't steal_bwd_input if this stage doesn't have backward"). There evaluation
    # walks the stages in order with plain send/recv instead.
    local_handoff = any(owner(s) == owner(s + 1) for s in range(n_stages - 1))

    def forward_only(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        with autocast(cfg, env.device):
            if local_handoff:
                return forward_stage_by_stage(
                    modules,
                    images if holds_first else None,
                    owner=owner,
                    pp_rank=pp_rank,
                    n_stages=n_stages,
                    shapes=shapes,
                    batch_size=chunk,
                    group=mesh.get_group("pp"),
                    device=env.device,
                )
            # [PP] schedule.eval() runs the same micro-batches forward only (the first stage takes the
            # images, the last the labels: its loss function runs, and the schedule returns the logits).
            return schedule.eval(*([images] if holds_first else []), target=labels if holds_last else None)

    def run_eval(step: int) -> None:
        for module in modules.values():
            module.eval()  # schedule.eval() does not switch dropout off: that is ours to do
        test_loss, test_accuracy = evaluate_pipeline(
            forward_only, data.test, data, replica=replica, dp=cfg.dp, batch_size=chunk, device=env.device
        )
        for module in modules.values():
            module.train()
            if isinstance(module, FSDPModule):
                module.reshard()  # forward-only left the parameters gathered; shard them again
        metrics.eval(step, test_loss=test_loss, test_accuracy=test_accuracy)

    # --profile-steps: torch.profiler and named spans over those steps only; without it, no-ops
    profiler = StepProfiler(
        cfg.profile_steps, out_dir=cfg.out, rank=env.rank, device=env.device, memory=cfg.memory_snapshot
    )
    clock = ActionClock(stages, profiler.span)  # [PP] when each action ran (timeline.json), a span per action

    # ---- training loop
    for step in range(start_step + 1, steps + 1):
        started = time.perf_counter()
        profiler.step_start(step)
        clock.start_step(started)
        lr = lr_at(step, cfg, last_step=steps)
        if optimizer:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
        with profiler.span("data"):
            indices = sampler.rank_batch(step, replica, cfg.dp)  # this replica's slice of the global batch
            images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for x, y in zip(images.split(chunk), labels.split(chunk)):
            losses: list[torch.Tensor] = []
            with autocast(cfg, env.device):
                # [PP] One step() runs all micro-batches of x through every stage, forward and backward.
                # Only the first stage gets inputs and only the last the targets; the others call it empty.
                schedule.step(
                    *([x] if holds_first else []),
                    target=y if holds_last else None,
                    losses=losses if holds_last else None,
                    return_outputs=False,
                )
            loss_sum += sum(loss.detach() for loss in losses)  # empty unless this rank holds the last stage
        # [PP] The loss reaches every rank: the last-stage ranks hold their replica's mean, the others 0.
        # This all-reduce also ends the step's pipeline window on every rank at the same moment.
        dist.all_reduce(loss_sum)
        loss_value = loss_sum.item() / cfg.dp
        meter.end_step(started)
        clock.end_step()
        check_finite(loss_value, step)
        # [PP] Clip by the norm of the whole model, not of this rank's stages: the sums of squares are added
        # over the pipeline ranks (other stages) and, with --dp, the replicas (FSDP2 shards of each stage), so
        # every stage scales by the same factor. Every rank takes part, also one without parameters.
        grad_groups = [mesh.get_group("pp")] + ([mesh.get_group("dp")] if cfg.dp > 1 else [])
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm, groups=grad_groups)
        if optimizer:
            with profiler.span("optimizer"):
                optimizer.step()
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
            save_checkpoint(
                cfg, step, model=local_model, optimizers=optimizers, steps_per_epoch=sampler.steps_per_epoch
            )

    memory = gather_memory(measure_memory(params, optimizer, env.device), env.rank)
    bubble = meter.report(
        cfg.out,
        write=is_logger,
        pp_size=pp_size,
        n_stages=n_stages,
        n_microbatches=cfg.n_microbatches,
        schedule=cfg.schedule,
        first_step=start_step + 1,
    )
    profile = profiler.report()
    clock.write(
        cfg.out,
        write=is_logger,
        pp_size=pp_size,
        step=steps,
        schedule=cfg.schedule,
        n_microbatches=cfg.n_microbatches,
        stage_layers=[list(piece._modules) for piece in pieces],
        bubble={key: bubble[key] for key in ("measured", "theory")} if bubble else None,
    )
    run_eval(steps)
    if is_logger:
        final = metrics.final()
        write_run_json(
            cfg.out,
            **describe_run(
                cfg,
                env,
                pipeline={
                    "pp_size": pp_size,
                    "n_stages": n_stages,
                    "logging_rank": env.rank,
                    "bubble": bubble,
                    "stages_of_each_pipeline_rank": [
                        stage_indices(cfg.schedule, r, pp_size, cfg.stages_per_rank) for r in range(pp_size)
                    ],
                    "evaluation": "stage by stage (send/recv)" if local_handoff else "schedule.eval()",
                },
                profile=profile,
            ),
            final=final,
            memory={"per_rank": memory},
        )
        log(bubble_summary(bubble))
        log(
            f"done: test accuracy {100 * final['test_accuracy']:.2f}% | {final['samples_per_s']:.0f} samples/s | "
            f"{final['wall_time_s']:.1f} s | {cfg.out}/metrics.jsonl, {cfg.out}/run.json"
        )
    metrics.close()


if __name__ == "__main__":
    run(main)
