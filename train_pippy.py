"""Train BabyCNN with pipeline parallelism (torch.distributed.pipelining).

    bash run_pippy.sh                                                  # 4 processes = 4 stages, 1F1B
    bash run_pippy.sh --schedule interleaved-1f1b --stages-per-rank 2  # 8 stages, 2 per rank
    bash run_pippy.sh --schedule zbv --stages-per-rank 2               # zero bubble, stages in a V
    bash run_pippy.sh --dp 2                                           # 2 replicas x 2 stages (2-D mesh)
    NPROC=8 bash run_pippy.sh --model vit --dp 2 --tp 2                # FSDP x PP x TP, a 3-D mesh (docs/mesh.md)
    NPROC=2 bash run_pippy.sh --model gpt                              # BabyGPT: its 2 blocks, a stage each
    torchrun --standalone --nproc-per-node 4 train_pippy.py            # the same as the first, by hand

The model is cut into consecutive stages, each rank holds one or more, and each replica's share of the
global batch streams through them in micro-batches in the order the schedule decides; the idle time (the
bubble) is measured into run.json and bubble.jsonl (docs/pipeline.md). Lines specific to pipelining are
marked `# [PP]`; with --tp, each stage's blocks are also split by heads over the TP ranks, by train_tp.py's wrap
(`# [TP]`), and sharded over the replicas by FSDP: the 3-D mesh of docs/mesh.md.
"""

from collections import OrderedDict
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as pp
from torch.distributed.tensor.parallel import ParallelStyle

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, blank_batch, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.model import build_model
from common.model_sizes import check_tp
from common.pipeline import compile_stages, describe_cut, eval_forward, split_model, stage_output_shapes
from common.pipeline_actions import StageActions
from common.pipeline_layout import PipelineLayout
from common.recorder import RunRecorder
from common.runs import total_steps
from common.training import autocast, build_optimizer, evaluate, loss_scaler, lr_at, set_lr
from common.training import loss_fn as cross_entropy
from train_tp import apply_tp

# [PP] The schedules, by --schedule (docs/pipeline.md draws each): names in torch.distributed.pipelining, looked
# up when used, so that a torch without the newest (DualPipeV: 2.9) still runs the others
SCHEDULES = {
    "gpipe": "ScheduleGPipe",  # all forwards, then all backwards (fill, drain)
    "1f1b": "Schedule1F1B",  # one forward, one backward in the steady state
    "interleaved-1f1b": "ScheduleInterleaved1F1B",  # 1F1B over several (looped) stages per rank
    "looped-bfs": "ScheduleLoopedBFS",  # breadth first: all micro-batches of a stage at once
    "interleaved-zb": "ScheduleInterleavedZeroBubble",  # backward split in input and weight parts (ZB1P)
    "zbv": "ScheduleZBVZeroBubble",  # zero bubble, stages placed in a V
    "dualpipev": "ScheduleDualPipeV",  # DeepSeek's DualPipe, V placement
}


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("pippy", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        layout = PipelineLayout.of(cfg, env.world_size)  # what the pipeline needs (the runners check it first)
        layout.check(chunk_size=cfg.chunk_size(env.world_size), compile=cfg.compile)
        check_tp(cfg, env.world_size)  # --tp: what the split needs of the model
        train(cfg, env)
    finally:
        teardown_distributed()


def apply_pipeline(
    modules: dict[int, nn.Module],
    n_stages: int,
    pp_group: dist.ProcessGroup,
    device: torch.device,
    *,
    dp_mesh: DeviceMesh | None = None,
    tp_mesh: DeviceMesh | None = None,
    tp_plan: dict[str, ParallelStyle] | None = None,
    io_shapes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] | None = None,
) -> list[PipelineStage]:
    """[PP] The wrap: a PipelineStage for each stage this rank holds (`modules`: {stage index: its module}, of
    `n_stages` in all), talking to the other ranks of its pipeline over `pp_group`; with `tp_mesh`, each stage's
    layers of `tp_plan` split over it first (train_tp.py's wrap); with `dp_mesh`, each stage FSDP2-sharded across
    the pipeline replicas. `io_shapes` ({stage: (input shape, output shape)} of one micro-batch) spares the stages
    inferring them at the first step (python -m planner's fake process group cannot)."""
    for module in modules.values():
        if tp_mesh is not None:  # [TP] this stage's part of the plan (its layers' names are the whole model's)
            apply_tp(module, tp_mesh, {name: s for name, s in tp_plan.items() if name.split(".")[0] in module._modules})
        if dp_mesh is not None and list(module.parameters()):  # (a parameter-free stage has nothing to shard)
            # [PP] FSDP2 across the replicas holding this stage. Not resharding after forward: the schedule
            # runs several micro-batch forwards per step; the pipeline reshards after the step's last backward
            # (and reduce-scatters the gradients then, once).
            fully_shard(module, mesh=dp_mesh, reshard_after_forward=False)

    def known(i: int) -> dict[str, tuple[torch.Tensor]]:  # the given shapes; none: inferred at the first step
        if io_shapes is None:
            return {}
        (inputs, outputs), empty = io_shapes[i], lambda shape: (torch.empty(shape, device=device),)
        grads = {"input_grads": empty(inputs)} if i > 0 else {}  # the images need no gradient
        # the stage reads from its example whether a received input needs a gradient: all but the images do
        received = (torch.empty(inputs, device=device, requires_grad=i > 0),)
        return {"input_args": received, "output_args": empty(outputs), "output_grads": empty(outputs), **grads}

    return [PipelineStage(modules[i], i, n_stages, device, group=pp_group, **known(i)) for i in modules]  # [PP]


def make_schedule(name: str, stages: list[PipelineStage], n_microbatches: int, loss_fn: Callable) -> object:
    """[PP] The schedule `name` that runs this rank's stages, each step's batch cut into `n_microbatches`.
    scale_grads=False: `loss_fn` already divides by the number of micro-batches, so the gradients summed over a
    step are those of the batch's mean. (The default, True, divides every .grad after the step's last backward:
    right for one step() of mean losses, but it would also shrink what an earlier step() accumulated.)"""
    schedule = getattr(pp, SCHEDULES[name])  # [PP]
    # [PP] a single-stage schedule takes this rank's one stage, the others the list
    stages_arg = stages[0] if issubclass(schedule, pp.PipelineScheduleSingle) else stages
    return schedule(stages_arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)  # [PP]


def train(cfg: Config, env: DistEnv) -> None:
    layout = PipelineLayout.of(cfg, env.world_size)  # [PP] ranks per pipeline, stages, which rank holds which
    # [PP] The mesh: "dp" the pipeline replicas, "pp" one pipeline's ranks, "tp" (--tp) the ranks splitting each
    # stage, innermost: rank = (replica * pp_size + pp_rank) * tp + tp_rank, a stage's TP ranks neighbours
    mesh = init_device_mesh(env.device.type, (layout.dp, layout.pp_size, cfg.tp), mesh_dim_names=("dp", "pp", "tp"))
    replica, pp_rank, pp_group = mesh.get_local_rank("dp"), mesh.get_local_rank("pp"), mesh.get_group("pp")
    my_stages = layout.stages_of(pp_rank)
    holds_first, holds_last = 0 in my_stages, layout.n_stages - 1 in my_stages
    # The loss exists only on the last stage: replica 0's last-stage rank logs and writes run.json. That
    # is pipeline rank p-1, except with the V schedules, which put the last stage back on rank 0.
    is_logger = holds_last and replica == 0 and mesh.get_local_rank("tp") == 0
    log = RankLogger(is_logger)
    log(f"pipeline | {layout}, {cfg.schedule} on {env.device.type}/{env.backend} | torch {torch.__version__}")

    # ---- data: every rank holds the whole data set; a replica takes its slice of each global batch
    data = load_dataset(cfg, download=env.world_size == 1)  # (the runners download before torchrun starts)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this replica runs per accumulation step: one schedule.step()
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: build the whole model on every rank (the same initial weights as DDP for the same
    # seed), cut it, and keep only this rank's stages.
    model = build_model(**cfg.model_kwargs(), **data.shape)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters")
    # [PP] The cut, the first layer of each stage (common/model_sizes.py: baby's table, stages of equal cost for the
    # larger sizes; never after a view, which the zero-bubble schedules refuse as a stage's output)
    pieces = split_model(model, layout.stage_starts)
    log(describe_cut(pieces, layout))
    shapes = stage_output_shapes(pieces, blank_batch(data, 1, torch.device("cpu")), batch_size=chunk_size)  # for eval
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    modules = {i: pieces[i].to(env.device) for i in my_stages}  # [PP] this rank's stages only
    # [TP] (--tp) which layers split how, by their names; BabyGPT's logits whole on the last stage, for the loss
    plan = model.tp_plan(loss_parallel=False) if cfg.model == "gpt" else model.tp_plan()
    if cfg.compile:  # [PP] a graph per stage module: the send/recv between stages stays outside the graphs
        compile_stages(list(modules.values()), env.device)
    dp, tp = (mesh[dim] if mesh[dim].size() > 1 else None for dim in ("dp", "tp"))  # [PP] FSDP, TP (--dp, --tp)
    stages = apply_pipeline(modules, layout.n_stages, pp_group, env.device, dp_mesh=dp, tp_mesh=tp, tp_plan=plan)
    scaler = loss_scaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # [PP] A micro-batch's mean loss (a language's: over its scored positions, as many in every sequence) divided
        # by the micro-batches (and accumulation steps): the losses the schedule returns add up to the batch's mean,
        # and their gradients to DDP's. fp16 scales it here, the only place a pipeline has the loss.
        return scaler.scale(cross_entropy(logits.float(), labels) / (cfg.n_microbatches * cfg.grad_accum_steps))

    schedule = make_schedule(cfg.schedule, stages, cfg.n_microbatches, loss_fn)  # [PP]
    # This rank's layers under their own names (conv1.weight, ...), as in the whole model: the module
    # that optimizer and checkpoints see, so a checkpoint of any strategy loads into any other.
    local_model = nn.Sequential(OrderedDict((n, m) for i in sorted(modules) for n, m in modules[i].named_children()))
    params = list(local_model.parameters())
    # A rank whose stages have no parameters (pooling, activations) has no optimizer at all.
    optimizer = build_optimizer(params, cfg) if params else None
    optimizers = [optimizer] if optimizer else []

    # resume or start afresh, save every --checkpoint-every steps, and on a preemption signal save and stop
    checkpoints = Checkpoints(cfg, local_model, optimizers, scaler, sampler=sampler, steps=steps, log=log)
    if (start_step := checkpoints.start()) is None:
        return  # a finished run: nothing to train, nothing rewritten
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=is_logger)
    recorder.track_memory(params, optimizer)  # what this rank keeps between steps
    # [PP] When each forward and backward ran on this rank: the bubble, the timeline, a span per action
    actions = StageActions(stages, device=env.device, span=recorder.span)

    # [PP] Evaluation through the pipeline: schedule.eval(), or stage by stage where it cannot (common/pipeline.py)
    precision = lambda: autocast(cfg, env.device)  # noqa: E731
    forward = eval_forward(schedule, modules, layout=layout, shapes=shapes, group=pp_group, precision=precision)

    def run_eval(step: int) -> None:
        for module in modules.values():
            module.eval()  # schedule.eval() does not switch dropout off: that is ours to do
        # each replica its shard of the test set, in batches of one schedule step's shape
        test = evaluate(forward, data, part=replica, parts=layout.dp, device=env.device, fixed_batch=chunk_size)
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
        # [PP] The loss reaches every rank: the last-stage ranks hold their replica's mean (each TP rank), others 0.
        # This all-reduce also ends the step's pipeline window on every rank at the same moment.
        dist.all_reduce(loss_sum)
        actions.end_step()  # [PP] the window closes, at the same moment on every rank
        # [PP] Clip by the norm of the whole model, not of this rank's stages: the sums of squares are added
        # over the pipeline ranks (other stages) and, with --dp, the replicas (FSDP2 shards of each stage: their
        # DTensor gradients say so), so every stage scales by the same factor. Every rank takes part, also one
        # without parameters.
        grad_norm = clip_grad_norm(params, cfg.max_grad_norm, groups=[pp_group], loss_scale=scaler.value)
        with recorder.span("optimizer"):
            # [PP] Every stage has the same norm: an fp16 overflow in any stage skips the step on every rank
            scaler.step(optimizer, grad_norm)  # (and every rank's scale stays the same, also one without parameters)
        recorder.train(step, loss=loss_sum.item() / (cfg.dp * cfg.tp), lr=lr, grad_norm=grad_norm, scaler=scaler)
        if recorder.eval_due(step):
            run_eval(step)
        if checkpoints.end_of_step(step, recorder):
            return  # stopped by a preemption signal, with this step's checkpoint

    run_eval(steps)
    layers = [list(piece._modules) for piece in pieces]  # each stage's, for the timeline
    bubble = actions.report(cfg.out, layout=layout, logs=is_logger, first_step=start_step + 1, stage_layers=layers)
    evaluation = "stage by stage (send/recv)" if layout.local_handoff else "schedule.eval()"
    pipeline = {**layout.describe(), "logging_rank": env.rank, "bubble": bubble, "evaluation": evaluation}
    pipeline["schedule_class"] = type(schedule).__name__  # the class that ran (bubble["orders"]: what it ran)
    recorder.finish(pipeline=pipeline, mesh=dict(zip(mesh.mesh_dim_names, mesh.shape)))


if __name__ == "__main__":
    run(main)
