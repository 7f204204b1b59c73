"""When each pipeline action ran, and the bubble that follows from it.

`StageActions` wraps each stage's forward, backward and weight-gradient method once and records every
training action -- forward (F), full backward (B) or its input part (I), weight gradient (W) of a micro-batch
-- with its start and end on this rank. From those intervals come run.json's bubble section, <out>/bubble.jsonl
(busy and idle seconds per step and rank) and <out>/timeline.json (the last step's actions, which
`python -m tools.timeline` draws); both hold the order each rank ran them in ("orders", "0F1" for stage 0's forward
of micro-batch 1), what the schedule that ran did, to set against what the configured one prescribes. While
--profile-steps is on each action is also a span in the trace ("forward stage 1 mb 2"). How to read the numbers:
docs/pipeline.md, "The bubble".
"""

from __future__ import annotations

import functools
import json
import os
import time
from collections import defaultdict
from typing import Any, Callable, ContextManager, Sequence

import torch
import torch.distributed as dist

from common.pipeline_layout import PipelineLayout

# (stage, kind, micro-batch); kind: F forward, B full backward, I input-gradient part, W weight-gradient part
Action = tuple[int, str, int]
BALANCED_COST = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}  # backward ~ twice a forward; B = I + W
SPAN_WORD = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


class StageActions:
    """The actions of this rank's stages, step by step. Call `start_step()` where a step's window opens and
    `end_step()` where it closes (after the loss all-reduce, which ends the pipeline on every rank at once); the
    rest of a window is waiting for a neighbour (the bubble) or communicating. The stages' methods are wrapped,
    not replaced: the schedule runs as without it."""

    def __init__(self, stages: Sequence, *, device: torch.device, span: Callable[[str], ContextManager]) -> None:
        self.span = span
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.current: list[tuple[int, str, int, float, float]] = []  # (stage, kind, mb, start, end), perf_counter s
        self.last: list[tuple[int, str, int, float, float]] = []
        self.window_start, self.last_window = 0.0, (0.0, 0.0)
        self.windows: list[tuple[float, float]] = []  # per step: (busy_s, window_s)
        self.same_order = True  # whether every step ran its actions in the same order as the one before
        # (stage, kind) -> [seconds, count]: the first step apart, because it also sets the pipeline up
        self.first_cost: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0])
        self.cost: dict[tuple[int, str], list[float]] = defaultdict(lambda: [0.0, 0])
        for stage in stages:
            stage.forward_one_chunk = self._wrap(stage, stage.forward_one_chunk, lambda kw: "F")
            stage.backward_one_chunk = self._wrap(
                stage, stage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
            )
            stage.backward_weight_one_chunk = self._wrap(stage, stage.backward_weight_one_chunk, lambda kw: "W")

    def _wrap(self, stage, method: Callable, kind_of: Callable[[dict], str]) -> Callable:
        @functools.wraps(method)
        def recorded(chunk_id, *args, **kwargs):
            kind = kind_of(kwargs)
            with self.span(f"{SPAN_WORD[kind]} stage {stage.stage_index} mb {chunk_id}"):
                self.sync()  # on a GPU, time the kernels, not their launch
                start = time.perf_counter()
                result = method(chunk_id, *args, **kwargs)
                self.sync()
            if stage.has_backward:  # training, not schedule.eval()
                self.current.append((stage.stage_index, kind, chunk_id, start, time.perf_counter()))
            return result

        return recorded

    def start_step(self) -> None:
        self.current, self.window_start = [], time.perf_counter()

    def end_step(self) -> None:
        end = time.perf_counter()
        self.windows.append((sum(e - s for *_, s, e in self.current), end - self.window_start))
        cost = self.first_cost if len(self.windows) == 1 else self.cost
        for stage, kind, _, start, stop in self.current:
            cost[stage, kind][0] += stop - start
            cost[stage, kind][1] += 1
        if len(self.windows) > 1:  # (a comparison of tuples per action: cheap beside the actions themselves)
            self.same_order &= [a[:3] for a in self.current] == [a[:3] for a in self.last]
        self.last, self.last_window = self.current, (self.window_start, end)

    def report(
        self, out_dir: str, *, layout: PipelineLayout, logs: bool, first_step: int, stage_layers: list[list[str]]
    ) -> dict | None:
        """Every rank calls this (it gathers). The rank that `logs` writes bubble.jsonl and timeline.json for the
        pipeline ranks of replica 0 (the other replicas run alike), prints the bubble's console line and gets
        run.json's bubble section."""
        costs = {
            f"{stage}{kind}": total / n for (stage, kind), (total, n) in sorted((self.cost or self.first_cost).items())
        }
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.windows, self.last, self.last_window, costs, self.same_order))
        if not logs:
            return None
        # replica 0's pipeline ranks (rank = (replica x pp_size + pp_rank) x tp + tp_rank), each its TP rank 0's
        windows, lasts, last_windows, costs, same_order = (
            list(x) for x in zip(*gathered[: layout.pp_size * layout.tp : layout.tp])
        )
        with open(os.path.join(out_dir, "bubble.jsonl"), "w") as f:  # per step, index = pipeline rank
            for i, step in enumerate(zip(*windows)):
                busy, idle = [round(b, 6) for b, _ in step], [round(w - b, 6) for b, w in step]
                f.write(json.dumps({"step": first_step + i, "busy_s": busy, "idle_s": idle}) + "\n")
        orders = [[(stage, kind, mb) for stage, kind, mb, _, _ in actions] for actions in lasts]
        bubble = bubble_report(windows, orders, costs, layout=layout)
        bubble["orders_step"], bubble["same_order_every_step"] = first_step + len(self.windows) - 1, all(same_order)
        # Times from the earliest rank's start of the step (one machine shares one monotonic clock; across
        # machines the rows may be shifted by clock offsets).
        origin = min(start for start, _ in last_windows)
        shift = lambda t: round(t - origin, 6)  # noqa: E731
        timeline = {
            "step": first_step + len(self.windows) - 1,
            "pp_size": layout.pp_size,
            "schedule": layout.schedule,
            "n_microbatches": layout.n_microbatches,
            "stage_layers": stage_layers,
            "bubble": {key: bubble[key] for key in ("measured", "theory")},
            "orders": bubble["orders"],  # each rank's actions in the order they ran ("0F1"), as in run.json
            "window_s": [[shift(start), shift(end)] for start, end in last_windows],
            "actions": [
                [{"stage": s, "kind": k, "mb": mb, "start": shift(t0), "end": shift(t1)} for s, k, mb, t0, t1 in acts]
                for acts in lasts
            ],
        }
        with open(os.path.join(out_dir, "timeline.json.tmp"), "w") as f:
            json.dump(timeline, f, indent=1)
        os.replace(os.path.join(out_dir, "timeline.json.tmp"), os.path.join(out_dir, "timeline.json"))
        print(bubble_summary(bubble), flush=True)
        return bubble


def action_name(action: Action) -> str:
    """'0F1' for (0, "F", 1): stage, kind, micro-batch, as torch.distributed.pipelining writes a schedule's actions."""
    stage, kind, mb = action
    return f"{stage}{kind}{mb}"


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
    schedule really ran them) and an action takes `cost(stage, kind)` (`simulate`). No communication time, no
    other load: what the schedule and the stage costs alone imply."""
    makespan, busy = simulate(orders, cost)
    return 1 - sum(busy) / (len(orders) * makespan)


def action_graph(orders: Sequence[Sequence[Action]]) -> tuple[list[list[tuple]], Callable[[tuple], list[tuple]]]:
    """Each rank's actions as keys (family F, B or W; stage; micro-batch; occurrence: with accumulation a step runs
    each micro-batch twice), and the keys an action waits for: the forward of the previous stage; the backward of
    the next stage and its own forward; a weight gradient, its input gradient."""
    n_stages = 1 + max(stage for order in orders for stage, _, _ in order)
    seen: dict[tuple, int] = defaultdict(int)
    keys: list[list[tuple]] = [[] for _ in orders]
    for rank, order in enumerate(orders):
        for stage, kind, mb in order:
            family = "F" if kind == "F" else "W" if kind == "W" else "B"
            keys[rank].append((family, stage, mb, seen[family, stage, mb]))
            seen[family, stage, mb] += 1

    def inputs(key: tuple) -> list[tuple]:
        family, stage, mb, run = key
        if family == "F":
            return [("F", stage - 1, mb, run)] if stage > 0 else []
        if family == "B":
            return [("F", stage, mb, run)] + ([("B", stage + 1, mb, run)] if stage < n_stages - 1 else [])
        return [("B", stage, mb, run)]

    return keys, inputs


def simulate(
    orders: Sequence[Sequence[Action]],
    cost: Callable[[int, str], float],
    transfer: Callable[[int, str], float] | None = None,
) -> tuple[float, list[float]]:
    """(the time the last rank finishes, each rank's busy time) when every rank runs its actions in
    `orders[rank]` and an action takes `cost(stage, kind)`: it starts when its rank is free and its inputs exist
    (`action_graph`), what an action sends arriving `transfer(stage, kind)` after it ends (none by default)."""
    keys, inputs = action_graph(orders)
    finished: dict[tuple, float] = {}
    position, free, busy = [0] * len(orders), [0.0] * len(orders), [0.0] * len(orders)
    while any(position[r] < len(order) for r, order in enumerate(orders)):
        progressed = False
        for rank, order in enumerate(orders):
            while position[rank] < len(order):
                key = keys[rank][position[rank]]
                ready = [finished.get(k) for k in inputs(key)]
                if None in ready:
                    break
                stage, kind, _ = order[position[rank]]
                start = max([free[rank], *ready])
                free[rank] = start + cost(stage, kind)
                busy[rank] += cost(stage, kind)
                finished[key] = free[rank] + (transfer(stage, kind) if transfer else 0.0)
                position[rank] += 1
                progressed = True
        if not progressed:
            raise RuntimeError("the recorded action orders depend on each other in a cycle")
    return max(free), busy


def bubble_report(
    windows: list[list[tuple[float, float]]],
    orders: list[list[Action]],
    costs: list[dict[str, float]],
    *,
    layout: PipelineLayout,
) -> dict:
    """run.json's bubble section, from each pipeline rank of one replica: its per-step (busy_s, window_s)
    (the first step, which also sets up the pipeline, is left out), the order of its last step's actions,
    and its mean seconds per (stage, kind) of action."""
    steps = list(zip(*windows))
    steps = steps[1:] or steps
    busy = [sum(step[r][0] for step in steps) for r in range(layout.pp_size)]
    window = [sum(step[r][1] for step in steps) for r in range(layout.pp_size)]
    measured_cost = {key: value for rank_costs in costs for key, value in rank_costs.items()}
    p, m, v = layout.pp_size, layout.n_microbatches, layout.stages_per_rank
    formula, value = {
        "gpipe": ("(p-1)/(m+p-1)", (p - 1) / (m + p - 1)),
        "1f1b": ("(p-1)/(m+p-1)", (p - 1) / (m + p - 1)),
        "interleaved-1f1b": ("(p-1)/(v*m+p-1)", (p - 1) / (v * m + p - 1)),
    }.get(layout.schedule, (None, None))
    return {
        "measured": 1 - sum(busy) / sum(window),
        "theory": simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]),
        "formula": formula,
        "formula_value": value,
        "expected_from_stage_times": simulate_bubble(orders, lambda stage, kind: measured_cost[f"{stage}{kind}"]),
        "busy_fraction_per_rank": [b / w for b, w in zip(busy, window)],
        # what ran: per pipeline rank, the last step's actions in their order ("0F1": stage 0, forward, micro-batch
        # 1; B full backward, I and W its input and weight parts), every schedule.step() of the step in turn
        "orders": [[action_name(action) for action in order] for order in orders],
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
        "i.e. the bubble that stage imbalance alone explains. orders = each pipeline rank's actions of "
        "step orders_step in the order they ran (same_order_every_step: every step ran them so).",
    }
