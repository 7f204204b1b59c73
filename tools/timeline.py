"""The pipeline as it ran: one row per rank, every action of the last training step at its measured times.

    python -m tools.timeline RUN_DIR --out FILE.png

RUN_DIR is a train_pippy.py run folder (it holds timeline.json, written by common/pipeline_actions.py).
Bars: F forward, B full backward, I backward to the input only, W weight gradient (zero-bubble schedules),
each labelled with its micro-batch and shaded by its stage; the grey band behind them is the rank's step
window, so the grey left showing is the rank's idle time (waiting for a neighbour, or communicating).
See docs/profiling.md for how to read the figures.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any, Sequence

from common.errors import UserError
from runner.entry import fail

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "I": "#c44e52", "W": "#55a868"}


class TimelineMissing(UserError):
    """The run folder has no timeline.json."""


def load_timeline(run_dir: str) -> dict[str, Any]:
    path = os.path.join(run_dir, "timeline.json")
    if not os.path.isfile(path):
        raise TimelineMissing(f"{run_dir}: no timeline.json; it is written by pipeline runs (run_pippy.sh)")
    with open(path) as f:
        return json.load(f)


def title(timeline: dict[str, Any]) -> str:
    bubble = timeline["bubble"]  # run.json's, from the same recorded actions (common/pipeline_actions.py)
    return (
        f"{timeline['schedule']}: {timeline['pp_size']} ranks, {timeline['n_microbatches']} micro-batches, "
        f"step {timeline['step']}\n"
        f"bubble measured {100 * bubble['measured']:.0f}%, theory {100 * bubble['theory']:.0f}%"
    )


def rank_label(rank: int, actions: Sequence[dict], stage_layers: Sequence[Sequence[str]]) -> str:
    stages = sorted({a["stage"] for a in actions})
    names = [f"s{s}: {stage_layers[s][0]}..{stage_layers[s][-1]}" for s in stages if s < len(stage_layers)]
    return "\n".join([f"rank {rank}", *names])


def draw(timeline: dict[str, Any], out: str) -> None:
    import matplotlib  # imported here: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = timeline["actions"]
    n_stages = max((a["stage"] for acts in ranks for a in acts), default=0) + 1
    span_ms = 1e3 * max(end for _, end in timeline["window_s"])
    fig, ax = plt.subplots(figsize=(12, 1.1 + 0.9 * len(ranks)))
    for rank, (actions, (w0, w1)) in enumerate(zip(ranks, timeline["window_s"])):
        y = len(ranks) - 1 - rank  # rank 0 on top
        ax.broken_barh([(1e3 * w0, 1e3 * (w1 - w0))], (y - 0.4, 0.8), color="#e6e6e6")  # idle shows grey
        for a in actions:
            start, width = 1e3 * a["start"], 1e3 * (a["end"] - a["start"])
            # later stages lighter, so the V schedules' two stages per rank tell apart
            alpha = 1.0 - 0.5 * a["stage"] / max(1, n_stages - 1)
            ax.broken_barh([(start, width)], (y - 0.35, 0.7), color=COLOURS[a["kind"]], alpha=alpha, ec="black", lw=0.3)
            if width > span_ms / 60:  # a label only where it fits
                ax.text(start + width / 2, y, f"{a['kind']}{a['mb']}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(ranks)))
    labels = [rank_label(r, acts, timeline["stage_layers"]) for r, acts in enumerate(ranks)]
    ax.set_yticklabels(labels[::-1], fontsize=7)
    ax.set_xlabel("time in the step (ms)")
    ax.set_title(title(timeline), fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*COLOURS.values(), "#e6e6e6")]
    names = ["F forward", "B backward", "I input grad", "W weight grad", "idle"]
    ax.legend(handles, names, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.timeline", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a train_pippy.py run folder (with timeline.json)")
    parser.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/timeline.png)")
    args = parser.parse_args(argv)
    try:
        timeline = load_timeline(args.run_dir)
    except UserError as e:
        fail(str(e))
    out = args.out or os.path.join(args.run_dir, "timeline.png")
    draw(timeline, out)
    print(f"timeline: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
