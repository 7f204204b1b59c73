"""Where the time model's compute misses, on one process: BabyCNN's and the ViT's training steps, eager and wrapped as
train_tp.py and train_fsdp.py wrap them on a world of one (the wraps' Python without any collective to wait for),
and the gradient norm every script takes after backward (common/clipping.py), each timed for real and set beside
the profile's parts of it (planner/timing.py: rank_time):

    python -m bench.steps --profile runs/machine/profile.json              # the runs' batch (128), all cores
    python -m bench.steps --profile runs/machine/profile.json --batch 2 --threads 1

Per step: its measured seconds; its operators timed alone now, one by one (`bench.machine.time_op`, the profile's
own way) against the profile's time for the same calls, which tells the machine's drift since the profile from a
miss of the model; the same operators timed inside the step (eager steps and the gradient norm), against alone, what
the step's order costs them; and what the step costs beyond its operators, measured (the step less its operators alone)
against the profile's overheads (a kernel call's, a DTensor call's, an FSDP unit's, once a step). Each step is
timed before and after its operators (the machine's speed drifts: bench.machine), all on pages already mapped, as
the profile timed them; the first touch of new pages a run adds is its own column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from bench.launches import CORES
from bench.report import fmt, md_table


def operators_inside(step: Any, repeats: int = 5) -> float:
    """Seconds a step's operators take inside it: each aten call of `repeats` steps timed as it runs (a dispatch mode
    around each; its own cost falls outside the timed calls). Against the same operators timed alone this is what
    the step's order costs them: inputs that others wrote before, out of the caches."""
    import time

    from torch.utils._python_dispatch import TorchDispatchMode

    class Timed(TorchDispatchMode):
        seconds = 0.0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            started = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.perf_counter() - started
            return out

    with (timed := Timed()):
        for _ in range(repeats):
            step()
    return timed.seconds / repeats


def parts(
    step: Any, count: Any, profile: Any, threads: int, *, whole: bool = True, inside: bool = True
) -> dict[str, float | None]:
    """Measured and predicted seconds of one step: the step, its operators alone and inside it, and what it costs
    beyond them. `whole`: a training step (the profile's cost once a step counts); else a part of one (the gradient
    norm). `inside`: time its operators inside it too (not under DTensor, whose own dispatch would count as theirs)."""
    from bench.machine import step_and_operators
    from planner.timing import rank_time

    compute_at = profile.for_threads(threads)
    measured, alone = step_and_operators(step, count.ops)
    work = sum(op.calls * compute_at.op_parts(op)[0] for op in count.ops.values())
    fresh = sum(op.calls * op.fresh_bytes for op in count.ops.values()) / (compute_at.fresh_bytes_per_s or float("inf"))
    # (the steps here run on pages kept, as the profile timed its operators and steps: what a run adds for its new
    # pages is the last column, left out of the rest)
    predicted = sum(rank_time(count, profile, procs_per_node=max(1, profile.cores // threads)).compute.values()) - fresh
    predicted -= 0.0 if whole else compute_at.step_overhead_s
    return {
        "measured_s": measured,
        "predicted_s": predicted,
        "operators_alone_s": alone,
        "operators_inside_s": operators_inside(step) if inside else None,
        "operators_predicted_s": work - fresh,
        "beyond_measured_s": measured - alone,
        "beyond_predicted_s": predicted - work + fresh,
        "fresh_pages_s": fresh,
    }


def table(rows: list[dict[str, Any]]) -> list[str]:
    """The rows of `parts` (with their model and wrap) as a markdown table, milliseconds."""
    header = ["model", "wrap", "step ms", "predicted", "error", "operators alone", "inside", "predicted"]
    header += ["beyond", "predicted", "new pages"]
    cells = [
        [r["model"], r["wrap"], fmt(r["measured_s"], ".1f", 1e3), fmt(r["predicted_s"], ".1f", 1e3)]
        + [fmt(r["measured_s"] / r["predicted_s"] - 1, "+.0%"), fmt(r["operators_alone_s"], ".1f", 1e3)]
        + [fmt(r["operators_inside_s"], ".1f", 1e3)]
        + [fmt(r["operators_predicted_s"], ".1f", 1e3), fmt(r["beyond_measured_s"], ".1f", 1e3)]
        + [fmt(r["beyond_predicted_s"], ".1f", 1e3), fmt(r["fresh_pages_s"], ".1f", 1e3)]
        for r in rows
    ]
    return md_table(header, cells)


def norm_steps() -> list[tuple[Any, Any]]:
    """(the scripts' gradient norm of a model's gradients as a step, its count in the optimizer phase, as the planner
    counts it) for each model of bench.machine.EAGER: ~100 calls of small operators in a loop of plain Python."""
    import functools

    import torch

    from bench.machine import EAGER
    from common.clipping import clip_grad_norm
    from common.config import Config
    from planner.count import StepCounter
    from planner.measure import _model

    steps = []
    for flags in EAGER:
        model = _model(Config(**flags))
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        step = functools.partial(clip_grad_norm, list(model.parameters()), 0.0)  # (0: measured only, as logged)
        step()
        with StepCounter(model) as counter, counter.phase("optimizer"):
            step()
        steps.append((step, counter.count))
    return steps


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, help="the machine's profile (python -m bench.machine)")
    parser.add_argument("--batch", type=int, default=128, help="samples a step (the runs': 128)")
    parser.add_argument("--threads", type=int, default=CORES, help="this process's threads (one process: all cores)")
    parser.add_argument("--json", help="also write every step's parts here")
    args = parser.parse_args(argv)
    from runner.entry import fail

    if args.batch < 1 or not 1 <= args.threads <= CORES:
        fail(f"--batch {args.batch} --threads {args.threads}: a batch of at least 1, and 1 to {CORES} threads")
    import torch

    from bench.machine import EAGER, _eager_steps, _wrapped_steps, keep_every_page
    from common.errors import ConfigError
    from planner.timing import load_profile

    try:
        profile = load_profile(args.profile)
    except ConfigError as e:
        fail(str(e))
    torch.set_num_threads(args.threads)
    keep_every_page()  # the steps and operators timed as the profile timed them: on pages already mapped
    names = [f"{flags.get('model', 'cnn')} {flags.get('model_size', 'baby')}" for flags in EAGER]
    steps = [(names[i], "eager", step, count) for i, (step, count) in enumerate(_eager_steps(args.batch))]
    wrapped = _wrapped_steps(args.batch)  # (TP, then FSDP, of each model in bench.machine.WRAPPED)
    steps += [(names[own], ("tp", "fsdp")[i % 2], step, count) for i, (own, step, count) in enumerate(wrapped)]
    steps += [(names[i], "grad norm", step, count) for i, (step, count) in enumerate(norm_steps())]
    rows = [
        {
            "model": m,
            "wrap": wrap,
            **parts(
                step, count, profile, args.threads, whole=wrap != "grad norm", inside=wrap in ("eager", "grad norm")
            ),
        }
        for m, wrap, step, count in steps
    ]
    print(f"batch {args.batch}, {args.threads} thread(s), profile {profile.name}; error: measured over predicted")
    print("\n".join(table(rows)))
    if args.json:
        command = " ".join(["python -m bench.steps", *(argv if argv is not None else sys.argv[1:])])
        Path(args.json).write_text(json.dumps({"command": command, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
