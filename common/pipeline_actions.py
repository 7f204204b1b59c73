"""When each pipeline action ran: the start and end of every forward (F), backward (B, or its input part I)
and weight-gradient (W) action of every micro-batch, on every pipeline rank, for the last training step.
train_pippy.py writes them to <out>/timeline.json; `python -m common.timeline` draws them.

The stages' methods are wrapped once more (over BubbleMeter's wrappers, so the times include its CUDA
synchronisation): two clock reads per action. While --profile-steps is on, each action is also a named
span in the trace ("forward stage 1 mb 2").
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, Callable, ContextManager, Sequence

import torch.distributed as dist

SPAN_WORD = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}


def wrap_actions(stages: Sequence, wrap: Callable[[Any, Callable, Callable[[dict], str]], Callable]) -> None:
    """Replace each stage's forward, backward and weight-gradient method by wrap(stage, method, kind_of), where
    kind_of(kwargs) names the action: F, B (a full backward) or I (its input part only), W."""
    for stage in stages:
        stage.forward_one_chunk = wrap(stage, stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = wrap(
            stage, stage.backward_one_chunk, lambda kw: "B" if kw.get("full_backward", True) else "I"
        )
        stage.backward_weight_one_chunk = wrap(stage, stage.backward_weight_one_chunk, lambda kw: "W")


class ActionClock:
    def __init__(self, stages: Sequence, span: Callable[[str], ContextManager]) -> None:
        self.span = span
        self.current: list[list] = []  # [stage, kind, micro-batch, start, end] in time.perf_counter() seconds
        self.last: list[list] = []
        self.step_start, self.last_window = 0.0, (0.0, 0.0)
        wrap_actions(stages, self._clocked)

    def _clocked(self, stage, method: Callable, kind_of: Callable[[dict], str]) -> Callable:
        @functools.wraps(method)
        def clocked(chunk_id, *args, **kwargs):
            kind = kind_of(kwargs)
            with self.span(f"{SPAN_WORD[kind]} stage {stage.stage_index} mb {chunk_id}"):
                start = time.perf_counter()
                result = method(chunk_id, *args, **kwargs)
            if stage.has_backward:  # training, not schedule.eval()
                self.current.append([stage.stage_index, kind, chunk_id, start, time.perf_counter()])
            return result

        return clocked

    def start_step(self, started: float) -> None:
        self.current, self.step_start = [], started

    def end_step(self) -> None:
        self.last, self.last_window = self.current, (self.step_start, time.perf_counter())

    def write(self, out_dir: str, *, write: bool, pp_size: int, step: int, **describe: Any) -> None:
        """Every rank calls this (it gathers); the rank with `write` writes <out>/timeline.json for the
        pipeline ranks of replica 0. Times are seconds from the earliest rank's start of the step (one
        machine shares one monotonic clock; across machines the rows may be shifted by clock offsets)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.last, self.last_window))
        if not write:
            return
        gathered = gathered[:pp_size]
        origin = min(window[0] for _, window in gathered)
        shift = lambda t: round(t - origin, 6)  # noqa: E731
        timeline = {
            "step": step,
            "pp_size": pp_size,
            **describe,
            "window_s": [[shift(w0), shift(w1)] for _, (w0, w1) in gathered],
            "actions": [
                [{"stage": s, "kind": k, "mb": mb, "start": shift(t0), "end": shift(t1)} for s, k, mb, t0, t1 in acts]
                for acts, _ in gathered
            ],
        }
        with open(os.path.join(out_dir, "timeline.json.tmp"), "w") as f:
            json.dump(timeline, f, indent=1)
        os.replace(os.path.join(out_dir, "timeline.json.tmp"), os.path.join(out_dir, "timeline.json"))
