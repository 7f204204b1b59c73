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

from collections import OrderedDict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage

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
from common.model import build_model
from common.pipeline import (
    build_schedule,
    compile_stages,
    describe_cut,
    forward_stage_by_stage,
    split_model,
    stage_output_shapes,
)
from common.pipeline_actions import StageActions
from common.pipeline_layout import PipelineLayout
from common.recorder import RunRecorder
from common.runs import already_done, total_steps
from common.traffic import Traffic, add, padded_shard
from common.training import LossScaler, autocast, build_optimizer, evaluate, lr_at, set_lr


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("pippy", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        train(cfg, env)
    finally:
        teardown_distributed()


def apply_pipeline(
    pieces: list[nn.Sequential],
    layout: PipelineLayout,
    mesh: DeviceMesh,
    cfg: Config,
    env: DistEnv,
    *,
    io_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
) -> tuple[dict[int, nn.Module], list[PipelineStage]]:
    """[PP] The wrap: this rank's stages (FSDP2-sharded across the replicas with --dp), a PipelineStage each.
    python -m planner builds them too, on a fake process group, which cannot infer activation shapes at the first
    step: it passes `io_shapes`, each stage's input and output shape for one micro-batch."""
    modules = {i: pieces[i] for i in layout.stages_of(mesh.get_local_rank("pp"))}
    if env.device.type != "cpu":  # (built on the CPU; the planner's fake tensors cannot move)
        modules = {i: module.to(env.device) for i, module in modules.items()}
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

    def known(i: int) -> dict[str, tuple[torch.Tensor]]:  # the planner's shapes; none: inferred at the first step
        if io_shapes is None:
            return {}
        (inputs, outputs), empty = io_shapes[i], lambda shape: (torch.empty(shape, device=env.device),)
        grads = {"input_grads": empty(inputs)} if i > 0 else {}  # the images need no gradient
        return {"input_args": empty(inputs), "output_args": empty(outputs), "output_grads": empty(outputs), **grads}

    # [PP] One PipelineStage per stage this rank holds.
    stages = [
        PipelineStage(modules[i], i, layout.n_stages, env.device, group=mesh.get_group("pp"), **known(i))
        for i in modules
    ]
    return modules, stages


def make_schedule(stages: list[PipelineStage], cfg: Config, scaler: LossScaler) -> object:
    """[PP] The schedule that runs this rank's stages. The loss of a micro-batch is its mean divided by the
    number of micro-batches (and accumulation steps): the gradients summed over the step are then those of the
    mean over this replica's batch, like DDP's, and the losses the schedule returns add up to that mean (hence
    scale_grads=False in build_schedule). fp16: the loss is scaled here, the only place a pipeline has it."""

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return scaler.scale(F.cross_entropy(logits.float(), labels) / (cfg.n_microbatches * cfg.grad_accum_steps))

    return build_schedule(cfg.schedule, stages, cfg.n_microbatches, loss_fn)


def pipeline_traffic(
    pieces: list[nn.Sequential], layout: PipelineLayout, pp_rank: int, example: torch.Tensor, cfg: Config, env: DistEnv
) -> Traffic:
    """[PP] What this rank moves per step (run.json "traffic"; docs/communication.md): for every micro-batch,
    each activation that crosses to a stage on another rank and, in backward, its gradient coming back; with
    --dp, each stage's FSDP2 all-gather and reduce-scatter over the replicas (once per schedule step)."""
    micro_batch = cfg.chunk_size(env.world_size) // cfg.n_microbatches
    times = cfg.n_microbatches * cfg.grad_accum_steps
    outputs, x = [], example[:1]
    with torch.no_grad(), autocast(cfg, torch.device("cpu")):  # the activations' shapes and dtypes
        for piece in pieces:
            x = piece(x)
            outputs.append((micro_batch * x[0].numel(), x.element_size()))
    traffic: Traffic = {}
    for s in layout.stages_of(pp_rank):
        if s + 1 < layout.n_stages and layout.owner(s + 1) != pp_rank:  # forward out, its gradient back in
            add(traffic, "send", elements=outputs[s][0], itemsize=outputs[s][1], times=times)
            add(traffic, "recv", elements=outputs[s][0], itemsize=outputs[s][1], times=times)
        if s > 0 and layout.owner(s - 1) != pp_rank:  # forward in, its gradient back out
            add(traffic, "recv", elements=outputs[s - 1][0], itemsize=outputs[s - 1][1], times=times)
            add(traffic, "send", elements=outputs[s - 1][0], itemsize=outputs[s - 1][1], times=times)
        elements = layout.dp * sum(padded_shard(tuple(p.shape), layout.dp) for p in pieces[s].parameters())
        if layout.dp > 1 and elements:
            add(traffic, "all_gather", elements=elements, itemsize=4, ranks=layout.dp, times=cfg.grad_accum_steps)
            add(traffic, "reduce_scatter", elements=elements, itemsize=4, ranks=layout.dp, times=cfg.grad_accum_steps)
    return traffic


def train(cfg: Config, env: DistEnv) -> None:
    layout = PipelineLayout.of(cfg, env.world_size)  # [PP] ranks per pipeline, stages, which rank holds which
    # [PP] A 2-D mesh: "dp" indexes the pipeline replicas, "pp" the ranks of one pipeline
    # (rank = replica * pp_size + pp_rank). Passing it explicitly lets the same code run on GPUs.
    mesh = init_device_mesh(env.device.type, (layout.dp, layout.pp_size), mesh_dim_names=("dp", "pp"))
    replica, pp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
    my_stages = layout.stages_of(pp_rank)
    holds_first, holds_last = 0 in my_stages, layout.n_stages - 1 in my_stages
    # The loss exists only on the last stage: replica 0's last-stage rank logs and writes run.json. That
    # is pipeline rank p-1, except with the V schedules, which put the last stage back on rank 0.
    is_logger = holds_last and replica == 0
    log = RankLogger(is_logger)
    log(
        f"pipeline | {env.world_size} processes = {layout.dp} replica(s) x {layout.pp_size} pipeline ranks on "
        f"{env.device.type} ({env.backend}) | {cfg.schedule}, {layout.n_stages} stages | torch {torch.__version__}"
    )

    # ---- data: every rank holds the whole data set; a replica takes its slice of each global batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this replica runs per accumulation step: one schedule.step()
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: build the whole model on every rank (the same initial weights as DDP for the same
    # seed), cut it, and keep only this rank's stages.
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
    # [PP] The explicit cut (common/model_sizes.py: a table for baby, stages of equal cost for the larger sizes).
    # `flatten` always opens a stage: its output is a view, and the zero-bubble schedules (torch 2.14.1) fail on
    # a stage whose output is a view.
    pieces = split_model(model, layout.stage_starts)
    traffic = pipeline_traffic(pieces, layout, pp_rank, data.train.images[:1].float(), cfg, env)  # [PP]
    log(describe_cut(pieces, layout))
    shapes = stage_output_shapes(pieces, data.train.images[:1].float(), batch_size=chunk_size)  # for evaluation
    seed_everything(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    modules, stages = apply_pipeline(pieces, layout, mesh, cfg, env)  # [PP]
    scaler = LossScaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed
    schedule = make_schedule(stages, cfg, scaler)  # [PP]

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
    if path := checkpoint_to_resume(cfg, log=log):
        start_step = load_checkpoint(path, model=local_model, optimizers=optimizers, scaler=scaler)
        log(f"resumed from {path} (step {start_step})")
    else:
        set_aside_previous_run(cfg)  # a new run: a previous one in --out moves to <out>.N, never overwritten
    if start_step >= steps:  # a finished run: nothing to train, nothing to rewrite
        log(already_done(cfg.out, start_step, steps))
        return
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=is_logger)
    recorder.track_memory(params, optimizer)  # what this rank keeps between steps
    # [PP] When each forward and backward ran on this rank: the bubble, the timeline, a span per action
    actions = StageActions(stages, device=env.device, span=recorder.span)

    def forward_only(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        with autocast(cfg, env.device):
            if layout.local_handoff:
                # [PP] Where two consecutive stages share a rank the schedule hands activations over locally,
                # and that path fails forward-only (torch 2.14.1: "can't steal_bwd_input if this stage doesn't
                # have backward"): walk the stages in order with plain send/recv instead.
                images = images if holds_first else None
                return forward_stage_by_stage(modules, images, layout=layout, shapes=shapes, group=mesh.get_group("pp"))
            # [PP] schedule.eval() runs the same micro-batches forward only (the first stage takes the
            # images, the last the labels: its loss function runs, and the schedule returns the logits).
            return schedule.eval(*([images] if holds_first else []), target=labels if holds_last else None)

    def run_eval(step: int) -> None:
        for module in modules.values():
            module.eval()  # schedule.eval() does not switch dropout off: that is ours to do
        # each replica its shard of the test set, in batches of one schedule step's shape
        test = evaluate(forward_only, data, part=replica, parts=layout.dp, device=env.device, fixed_batch=chunk_size)
        recorder.eval(step, *test)
        for module in modules.values():
            module.train()
            if isinstance(module, FSDPModule):
                module.reshard()  # forward-only left the parameters gathered; shard them again

    # ---- training loop
    for step in recorder.steps():
        actions.start_step()  # [PP] the step's window opens (the bubble is what the actions leave of it)
        lr = lr_at(step, cfg, last_step=steps)
        if optimizer:
            set_lr(optimizer, lr)
            optimizer.zero_grad(set_to_none=True)
        with recorder.span("data"):
            indices = sampler.rank_batch(step, replica, layout.dp)  # this replica's slice of the global batch
            images, labels = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for x, y in zip(images.split(chunk_size), labels.split(chunk_size)):
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
            # empty unless this rank holds the last stage; fp16: unscaled (exact: the scale is a power of two)
            loss_sum += sum(loss.detach() for loss in losses) / scaler.value
        # [PP] The loss reaches every rank: the last-stage ranks hold their replica's mean, the others 0.
        # This all-reduce also ends the step's pipeline window on every rank at the same moment.
        dist.all_reduce(loss_sum)
        actions.end_step()  # [PP] the window closes, at the same moment on every rank
        # [PP] Clip by the norm of the whole model, not of this rank's stages: the sums of squares are added
        # over the pipeline ranks (other stages) and, with --dp, the replicas (FSDP2 shards of each stage: their
        # DTensor gradients say so), so every stage scales by the same factor. Every rank takes part, also one
        # without parameters.
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm, groups=[mesh.get_group("pp")], loss_scale=scaler.value)
        with recorder.span("optimizer"):
            # [PP] Every stage has the same norm: an fp16 overflow in any stage skips the step on every rank
            scaler.step(optimizer, grad_norm)  # (and every rank's scale stays the same, also one without parameters)
        recorder.train(step, loss=loss_sum.item() / cfg.dp, lr=lr, grad_norm=grad_norm, scaler=scaler)
        if cfg.eval_every and step % cfg.eval_every == 0 and step != steps:
            run_eval(step)
        # preemption: SIGTERM/SIGUSR1 on any rank, learnt by all ranks here (after the last step the run just ends)
        stop = stop_requested() if step < steps else None
        if stop or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            save_checkpoint(
                cfg,
                step,
                model=local_model,
                optimizers=optimizers,
                scaler=scaler,
                steps_per_epoch=sampler.steps_per_epoch,
            )
        if stop:  # every rank saved this step: a resumed run repeats the uninterrupted one bit for bit
            log(f"stopped by {stop} after step {step} of {steps}, with its checkpoint: --resume continues")
            recorder.close()
            return

    run_eval(steps)
    stage_layers = [list(piece._modules) for piece in pieces]
    bubble = actions.report(
        cfg.out, layout=layout, logs=is_logger, first_step=start_step + 1, stage_layers=stage_layers
    )
    evaluation = "stage by stage (send/recv)" if layout.local_handoff else "schedule.eval()"
    pipeline = {**layout.describe(), "logging_rank": env.rank, "bubble": bubble, "evaluation": evaluation}
    recorder.finish(traffic=traffic, pipeline=pipeline)


if __name__ == "__main__":
    run(main)
