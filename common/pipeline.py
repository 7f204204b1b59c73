"""The parts of pipeline training that are not the pipeline itself: the schedule table, the cut (where is in
common/pipeline_layout.py), compiling a stage, and a forward-only walk through the stages for evaluation where
the schedule cannot do it.

train_pippy.py keeps the strategy lines (the cut, the stages, the schedule, the loop); where the stages live
is common/pipeline_layout.py, and when each action ran (the bubble, the timeline) common/pipeline_actions.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from common.compiling import require_compiler
from common.distributed import collective_device
from common.pipeline_layout import SINGLE_STAGE_SCHEDULES, PipelineLayout

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,  # all forwards, then all backwards (fill, drain)
    "1f1b": Schedule1F1B,  # one forward, one backward in the steady state
    "interleaved-1f1b": ScheduleInterleaved1F1B,  # 1F1B over several (looped) stages per rank
    "looped-bfs": ScheduleLoopedBFS,  # breadth first: all micro-batches of a stage at once
    "interleaved-zb": ScheduleInterleavedZeroBubble,  # backward split in input and weight parts (ZB1P)
    "zbv": ScheduleZBVZeroBubble,  # zero bubble, stages placed in a V
    "dualpipev": ScheduleDualPipeV,  # DeepSeek's DualPipe, V placement
}


def build_schedule(name: str, stages: list, n_microbatches: int, loss_fn: Callable) -> object:
    """The schedule object for `name`; single-stage schedules take this rank's one stage."""
    schedule_class = SCHEDULE_CLASSES[name]
    # scale_grads=False: the loss function already divides by the number of micro-batches (see
    # train_pippy.py). The default, True, divides every .grad by n_microbatches after the step's last
    # backward -- correct for one step() of mean losses, but it would also shrink gradients that an earlier
    # step() accumulated (--grad-accum-steps), and the losses it reports are per-micro-batch means.
    kwargs = {"n_microbatches": n_microbatches, "loss_fn": loss_fn, "scale_grads": False}
    if name in SINGLE_STAGE_SCHEDULES:
        return schedule_class(stages[0], **kwargs)
    return schedule_class(stages, **kwargs)


def compile_stages(modules: list[nn.Module], device: torch.device) -> None:
    """Compile each pipeline stage's forward, with the gradients it returns for its inputs made contiguous.

    A stage's input gradients are sent to the previous stage into a buffer laid out like the first one;
    inductor may return them in another layout, a strided view, which gloo refuses to send or receive (seen
    with torch 2.15.0; 2.14.1 returned contiguous ones in the suite's configurations).
    The pre-hook that fixes the layout runs eagerly, outside the graph, so only `forward` is compiled.
    """
    require_compiler(device.type)

    class ContiguousGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            return grad.contiguous()

    def contiguous_input_grads(module: nn.Module, args: tuple) -> tuple:
        return tuple(ContiguousGrad.apply(a) if isinstance(a, torch.Tensor) and a.requires_grad else a for a in args)

    for module in modules:
        module.register_forward_pre_hook(contiguous_input_grads)
        module.forward = torch.compile(module.forward)


def split_model(model: nn.Module, starts: Sequence[str]) -> list[nn.Sequential]:
    """Cut `model` into consecutive stages, the first layer of each named by `starts` (PipelineLayout.stage_starts).
    The stages share the model's layers (no copy), and each keeps the layer names, so `stage.state_dict()` keys
    match the model's."""
    names = list(model._modules)
    bounds = [names.index(name) for name in starts] + [len(names)]
    return [
        nn.Sequential(OrderedDict((name, model._modules[name]) for name in names[a:b]))
        for a, b in zip(bounds, bounds[1:])
    ]


def describe_cut(pieces: Sequence[nn.Module], layout: PipelineLayout) -> str:
    """One line per stage: which layers it runs, on which pipeline rank, with how many parameters."""
    return "\n".join(
        f"  stage {i} on pipeline rank {layout.owner(i)}: {', '.join(piece._modules)} "
        f"({sum(p.numel() for p in piece.parameters()):,} parameters)"
        for i, piece in enumerate(pieces)
    )


def stage_output_shapes(pieces: Sequence[nn.Module], example: torch.Tensor, batch_size: int) -> list[tuple[int, ...]]:
    """The shape of each stage's output for a batch of `batch_size` like `example`."""
    shapes, x = [], example[:1]
    with torch.no_grad():
        for piece in pieces:
            x = piece(x)
            shapes.append((batch_size, *x.shape[1:]))
    return shapes


@torch.no_grad()
def forward_stage_by_stage(
    modules: dict[int, nn.Module],
    images: torch.Tensor | None,
    *,
    layout: PipelineLayout,
    shapes: list[tuple[int, ...]],
    group: dist.ProcessGroup,
) -> torch.Tensor | None:
    """Forward one batch through every stage in order, without a schedule: each rank of the pipeline `group`
    runs the stages it holds (`modules`) and sends the activation on with a plain send/recv when the next stage
    lives elsewhere; activations travel in fp32, so the receiver knows the buffer to post (`shapes`). For where
    the schedule's forward-only path fails (train_pippy.py says where). Returns the logits on the last stage's
    rank, None elsewhere."""
    x, pp_rank, last = images, dist.get_rank(group), layout.n_stages - 1
    for s in layout.stages_of(pp_rank):
        if s > 0 and layout.owner(s - 1) != pp_rank:
            x = torch.empty(shapes[s - 1], device=collective_device())
            dist.recv(x, group=group, group_src=layout.owner(s - 1))
        x = modules[s](x)
        if s < last and layout.owner(s + 1) != pp_rank:
            dist.send(x.float().contiguous(), group=group, group_dst=layout.owner(s + 1))
    return x if layout.owner(last) == pp_rank else None
