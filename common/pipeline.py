"""The parts of pipeline training that are not the pipeline itself: the cut (where is in
common/pipeline_layout.py), compiling a stage, and evaluation through the stages.

train_pippy.py keeps the strategy lines (the stages, the schedule, the loop); where the stages live
is common/pipeline_layout.py, and when each action ran (the bubble, the timeline) common/pipeline_actions.py.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, ContextManager, Sequence

import torch
import torch.distributed as dist
from torch import nn

from common.distributed import collective_device
from common.optional_checks import require_compiler
from common.pipeline_layout import PipelineLayout


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


def eval_forward(
    schedule: object,
    modules: dict[int, nn.Module],
    *,
    layout: PipelineLayout,
    shapes: list,
    group: dist.ProcessGroup,
    precision: Callable[[], ContextManager],
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]:
    """`forward(images, labels)` for evaluation on this pipeline rank: the logits on the last stage's rank, None on
    the others. schedule.eval() runs the step's micro-batches forward only (the first stage takes the images, the
    last the labels: its loss function runs, and the schedule returns the logits). Where two consecutive stages
    share a rank the schedule hands activations over locally, and that path fails forward-only (torch 2.14.1:
    "can't steal_bwd_input if this stage doesn't have backward"): the stages are walked in order instead.
    `precision`: the training's autocast, for the same arithmetic."""
    mine = layout.stages_of(dist.get_rank(group))
    first, last = 0 in mine, layout.n_stages - 1 in mine

    def forward(images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
        with precision():
            if layout.local_handoff:
                images = images if first else None
                return forward_stage_by_stage(modules, images, layout=layout, shapes=shapes, group=group)
            return schedule.eval(*([images] if first else []), target=labels if last else None)

    return forward
