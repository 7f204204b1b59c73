"""The parts of pipeline training that are not the pipeline itself: which stages a rank holds, the
schedule table, forward-only evaluation, and the bubble made visible (measured and in theory).

train_pippy.py keeps the strategy lines (the cut, the stages, the schedule, the loop); this module holds
what would otherwise make that script long without making it clearer.
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import defaultdict
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
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

from common.config import SINGLE_STAGE_SCHEDULES, V_SCHEDULES
from common.data import DataSet, Split, longest_shard, shard_range, to_device_batch
from common.pipeline_actions import wrap_actions

SCHEDULE_CLASSES = {
    "gpipe": ScheduleGPipe,  # all forwards, then all backwards (fill, drain)
    "1f1b": Schedule1F1B,  # one forward, one backward in the steady state
    "interleaved-1f1b": ScheduleInterleaved1F1B,  # 1F1B over several (looped) stages per rank
    "looped-bfs": ScheduleLoopedBFS,  # breadth first: all micro-batches of a stage at once
    "interleaved-zb": ScheduleInterleavedZeroBubble,  # backward split in input and weight parts (ZB1P)
    "zbv": ScheduleZBVZeroBubble,  # zero bubble, stages placed in a V
    "dualpipev": ScheduleDualPipeV,  # DeepSeek's DualPipe, V placement
}


def stage_indices(schedule: str, pp_rank: int, pp_size: int, stages_per_rank: int) -> list[int]:
    """The stages rank `pp_rank` of a pipeline of `pp_size` ranks holds.

    Looped placement (the default): rank r holds r, r + p, r + 2p, ... The V schedules fold the pipeline
    back: rank r holds r and 2p - 1 - r, so the first AND the last stage live on rank 0.
    """
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + k * pp_size for k in range(stages_per_rank)]


def stage_owner(schedule: str, stage: int, pp_size: int) -> int:
    """The pipeline rank that holds `stage` (the inverse of stage_indices)."""
    if schedule in V_SCHEDULES:
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


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


def describe_cut(pieces: Sequence[nn.Module], owner: Callable[[int], int]) -> list[str]:
    """One line per stage: which layers it runs, on which pipeline rank, with how many parameters."""
    return [
        f"  stage {i} on pipeline rank {owner(i)}: {', '.join(piece._modules)} "
        f"({sum(p.numel() for p in piece.parameters()):,} parameters)"
        for i, piece in enumerate(pieces)
    ]


# ---------------------------------------------------------------------------------------------- the bubble
# (stage, kind, micro-batch); kind: F forward, B full backward, I input-gradient part, W weight-gradient part
Action = tuple[int, str, int]
BALANCED_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward ~ twice a forward; B = I + W


class BubbleMeter:
    """Measures the bubble on one rank: the seconds its stages spend computing -- forward, backward and
    (zero-bubble schedules) the separate weight-gradient pass -- within each step's window, and the order
    in which the schedule ran those actions. The rest of a window is waiting for a neighbour (the bubble)
    or communication. The stages' own methods are wrapped, not replaced: the schedule runs as without it."""

    def __init__(self, stages: Sequence, device: torch.device) -> None:
        self.busy_s = 0.0
        self.order: list[Action] = []  # the current step's actions, in execution order
        self.last_order: list[Action] = []
        self.windows: list[tuple[float, float]] = []  # per step: (busy_s, window_s)
        self.cost_s: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0])  # (stage, kind) -> [s, n]
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        wrap_actions(stages, self._timed)

    def _timed(self, stage, method: Callable, kind_of: Callable[[dict], str]) -> Callable:
        @functools.wraps(method)
        def timed(chunk_id, *args, **kwargs):
            self.sync()  # on a GPU, time the kernels, not their launch
            start = time.perf_counter()
            try:
                return method(chunk_id, *args, **kwargs)
            finally:
                self.sync()
                seconds = time.perf_counter() - start
                if stage.has_backward:  # training, not schedule.eval()
                    kind = kind_of(kwargs)
                    self.busy_s += seconds
                    self.order.append((stage.stage_index, kind, chunk_id))
                    self.cost_s[stage.stage_index, kind][0] += seconds
                    self.cost_s[stage.stage_index, kind][1] += 1

        return timed

    def end_step(self, started: float) -> None:
        """Close the step whose window opened at `started` (time.perf_counter())."""
        self.windows.append((self.busy_s, time.perf_counter() - started))
        if len(self.windows) == 1:
            self.cost_s.clear()  # the first step also sets the pipeline up: its times are not typical
        self.busy_s, self.last_order, self.order = 0.0, self.order, []

    def report(
        self,
        out_dir: str,
        *,
        write: bool,
        pp_size: int,
        n_stages: int,
        n_microbatches: int,
        schedule: str,
        first_step: int,
    ) -> dict | None:
        """Every rank calls this (it gathers). The rank with `write` gets run.json's bubble section and
        writes <out>/bubble.jsonl, both from the pipeline ranks of replica 0 (the others run alike)."""
        timing: list = [None] * dist.get_world_size()
        costs = {f"{stage}{kind}": total / n for (stage, kind), (total, n) in sorted(self.cost_s.items())}
        dist.all_gather_object(timing, (self.windows, self.last_order, costs))
        if not write:
            return None
        windows, orders, costs = (list(x) for x in zip(*timing[:pp_size]))
        with open(os.path.join(out_dir, "bubble.jsonl"), "w") as f:  # per step, index = pipeline rank
            for i, step in enumerate(zip(*windows)):
                f.write(
                    json.dumps(
                        {
                            "step": first_step + i,
                            "busy_s": [round(b, 6) for b, _ in step],
                            "idle_s": [round(w - b, 6) for b, w in step],
                        }
                    )
                    + "\n"
                )
        return bubble_report(
            windows, orders, costs, pp_size=pp_size, n_stages=n_stages, n_microbatches=n_microbatches, name=schedule
        )


def bubble_summary(report: dict) -> str:
    """The console line."""
    return (
        f"bubble: {100 * report['measured']:.0f}% of the pipeline's time idle | theory with balanced stages "
        f"{100 * report['theory']:.0f}%, with these stages' measured times "
        f"{100 * report['expected_from_stage_times']:.0f}% | busy share per rank "
        f"{' '.join(f'{100 * b:.0f}%' for b in report['busy_fraction_per_rank'])}"
    )


def simulate_bubble(orders: Sequence[Sequence[Action]], cost: Callable[[int, str], float]) -> float:
    """Idle share of the pipeline when every rank runs its actions in `orders[rank]` (the order the
    schedule really ran them) and an action takes `cost(stage, kind)`: it starts when its rank is free
    and its input exists (the forward of the previous stage; the backward of the next stage and its own
    forward). No communication time, no other load: what the schedule and the stage costs alone imply."""
    n_stages = 1 + max(stage for order in orders for stage, _, _ in order)
    finished: dict[tuple, float] = {}
    position, free, busy = [0] * len(orders), [0.0] * len(orders), [0.0] * len(orders)
    seen: dict[tuple, int] = defaultdict(int)  # occurrences: with accumulation a step runs each micro-batch twice
    keys = [[] for _ in orders]
    for rank, order in enumerate(orders):
        for stage, kind, mb in order:
            family = "F" if kind == "F" else "W" if kind == "W" else "B"
            keys[rank].append((family, stage, mb, seen[family, stage, mb]))
            seen[family, stage, mb] += 1

    def inputs(family: str, stage: int, mb: int, run: int) -> list[tuple]:
        if family == "F":
            return [("F", stage - 1, mb, run)] if stage > 0 else []
        if family == "B":
            return [("F", stage, mb, run)] + ([("B", stage + 1, mb, run)] if stage < n_stages - 1 else [])
        return [("B", stage, mb, run)]

    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                key = keys[rank][position[rank]]
                ready = [finished.get(k) for k in inputs(*key)]
                if None in ready:
                    break
                stage, kind, _ = order[position[rank]]
                start = max([free[rank], *ready])
                free[rank] = start + cost(stage, kind)
                busy[rank] += cost(stage, kind)
                finished[key] = free[rank]
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded action orders depend on each other in a cycle")
    return 1 - sum(busy) / (len(orders) * max(free))


def bubble_report(
    windows: list[list[tuple[float, float]]],
    orders: list[list[Action]],
    costs: list[dict[str, float]],
    *,
    pp_size: int,
    n_microbatches: int,
    n_stages: int,
    name: str,
) -> dict:
    """run.json's bubble section, from each pipeline rank of one replica: its per-step (busy_s, window_s)
    (the first step, which also sets up the pipeline, is left out), the order of its last step's actions,
    and its mean seconds per (stage, kind) of action."""
    steps = list(zip(*windows))
    steps = steps[1:] or steps
    busy = [sum(step[r][0] for step in steps) for r in range(pp_size)]
    window = [sum(step[r][1] for step in steps) for r in range(pp_size)]
    measured_cost = {key: value for rank_costs in costs for key, value in rank_costs.items()}
    p, m, v = pp_size, n_microbatches, n_stages // pp_size
    formula, value = {
        "gpipe": ("(p-1)/(m+p-1)", (p - 1) / (m + p - 1)),
        "1f1b": ("(p-1)/(m+p-1)", (p - 1) / (m + p - 1)),
        "interleaved-1f1b": ("(p-1)/(v*m+p-1)", (p - 1) / (v * m + p - 1)),
    }.get(name, (None, None))
    return {
        "measured": 1 - sum(busy) / sum(window),
        "theory": simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]),
        "formula": formula,
        "formula_value": value,
        "expected_from_stage_times": simulate_bubble(orders, lambda stage, kind: measured_cost[f"{stage}{kind}"]),
        "busy_fraction_per_rank": [b / w for b, w in zip(busy, window)],
        "seconds_per_action": measured_cost,
        "steps_measured": len(steps),
        "p": p,
        "m": m,
        "v": v,
        "definition": "measured = 1 - sum(busy) / sum(window) over the pipeline ranks of replica 0 and the "
        "steps after the first; busy = time in stage forward/backward, window = from the start "
        "of a step to the end of its loss all-reduce. theory = the idle share of the same "
        "action order with balanced stages (forward 1, backward 2, input/weight backward 1 "
        "each); expected_from_stage_times = the same with each action's measured mean time, "
        "i.e. the bubble that stage imbalance alone explains.",
    }


# ---------------------------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate_pipeline(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None],
    split: Split,
    data: DataSet,
    *,
    replica: int,
    dp: int,
    batch_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
) -> tuple[float, float]:
    """(test loss, test accuracy) over the whole of `split`, run through the pipeline.

    Replica r evaluates its contiguous shard of the test set in batches of exactly `batch_size` (the
    shape of one training step): the pipeline's communication buffers were sized by the first step, so a
    short last batch would fail late or abort gloo. It is padded with copies of image 0 instead, and only
    its real rows are counted. `forward(images, labels)` returns the logits on the rank that holds the
    last stage and None elsewhere; sums are reduced over all ranks, so every rank gets the result.
    """
    shard = shard_range(len(split), replica, dp)
    longest = longest_shard(len(split), dp)  # every replica runs as many batches as the longest shard needs
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # loss sum, hits, count
    for start in range(0, max(longest, 1), batch_size):
        indices = torch.arange(shard.start + start, min(shard.start + start + batch_size, shard.stop))
        n_real = len(indices)
        padded = torch.cat([indices, indices.new_zeros(batch_size - n_real)])
        images, labels = to_device_batch(split, padded, data, device, dtype)
        logits = forward(images, labels)
        if logits is not None:
            logits, labels = logits[:n_real].float(), labels[:n_real]
            totals[0] += F.cross_entropy(logits, labels, reduction="sum").double()
            totals[1] += (logits.argmax(dim=1) == labels).sum()
            totals[2] += n_real
    dist.all_reduce(totals)  # only the last-stage rank of each replica contributed
    loss_sum, hits, count = totals.tolist()
    return loss_sum / count, hits / count


def stage_output_shapes(pieces: Sequence[nn.Module], example: torch.Tensor) -> list[tuple[int, ...]]:
    """The shape of each stage's output for one sample (batch dimension left out)."""
    shapes, x = [], example[:1]
    with torch.no_grad():
        for piece in pieces:
            x = piece(x)
            shapes.append(tuple(x.shape[1:]))
    return shapes


@torch.no_grad()
def forward_stage_by_stage(
    modules: dict[int, nn.Module],
    images: torch.Tensor | None,
    *,
    owner: Callable[[int], int],
    pp_rank: int,
    n_stages: int,
    shapes: list[tuple[int, ...]],
    batch_size: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor | None:
    """Forward one batch through every stage in order, without a schedule: each rank runs the stages it
    holds and sends the activation on with a plain send/recv when the next stage lives elsewhere. Used
    for the V schedules, whose forward-only `schedule.eval()` fails on this torch. Activations travel in
    fp32 so that the receiver knows the buffer to post. Returns the logits on the last stage's rank."""
    x = images
    for s in range(n_stages):
        if owner(s) != pp_rank:
            continue
        if s > 0 and owner(s - 1) != pp_rank:
            x = torch.empty((batch_size, *shapes[s - 1]), device=device)
            dist.recv(x, group=group, group_src=owner(s - 1))
        x = modules[s](x)
        if s < n_stages - 1 and owner(s + 1) != pp_rank:
            dist.send(x.float().contiguous(), group=group, group_dst=owner(s + 1))
    return x if owner(n_stages - 1) == pp_rank else None
