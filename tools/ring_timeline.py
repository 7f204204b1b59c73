"""Context parallelism's ring as it ran: one row per rank, one attention layer's forward on a shared time axis.

    python -m tools.ring_timeline RUN_DIR --out FILE.png [--layer 0]

RUN_DIR is a train_cp.py run folder profiled with --profile-steps (it holds run.json and traces/rank*.json).
Per rank: the attention blocks it computed (torch's fused kernel, one per ring step, labelled with the rank whose
keys and values it used), and above and below them the send and receive of the next key/value chunk, from
the moment each is started to the moment it completes. A transfer that starts before the block beside it is the
ring's overlap. Traces of one machine share a clock; see docs/context-parallel.md for how to read the figure.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
from typing import Any, Sequence

from common.errors import UserError
from runner.entry import fail

BLOCK_OPS = (  # the fused attention kernels common/ring_attention.py calls once per ring step (forward)
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
)
COLOURS = {"block": "#4c72b0", "send": "#dd8452", "recv": "#55a868"}
Span = tuple[float, float]  # (start, end) in µs on the traces' clock


class RingTraceError(UserError):
    """The run folder has no CP traces, or they lack the ring's events."""


def load_run(run_dir: str) -> tuple[int, list[list[dict[str, Any]]]]:
    """(cp, each rank's trace events, in rank order) of a profiled train_cp.py run."""
    paths = glob.glob(os.path.join(run_dir, "traces", "rank*.json"))
    if not paths:
        raise RingTraceError(f"{run_dir}: no traces/rank*.json; a train_cp.py run with --profile-steps writes them")
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            cp = int(json.load(f)["mesh"]["cp"])
    except (OSError, KeyError, TypeError, ValueError):
        raise RingTraceError(f"{run_dir}: no run.json with mesh.cp; is it a train_cp.py run?") from None
    paths.sort(key=lambda p: int(re.findall(r"\d+", os.path.basename(p))[0]))
    traces = []
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        traces.append([e for e in trace.get("traceEvents", []) if e.get("ph") == "X"])
    return cp, traces


def ring_spans(events: list[dict[str, Any]], cp: int, layer: int) -> dict[str, list[Span]]:
    """One rank's forward ring of attention layer `layer` in the first profiled step: its cp blocks and the cp - 1
    sends and receives (each layer's forward makes exactly these; nothing else in a CP step sends point to point)."""
    steps = sorted((e for e in events if re.fullmatch(r"step \d+", e["name"])), key=lambda e: e["ts"])
    if steps:  # several profiled steps: the first
        t0, t1 = steps[0]["ts"], steps[0]["ts"] + steps[0]["dur"]
        events = [e for e in events if t0 <= e["ts"] <= t1]

    def spans(names: Sequence[str], count: int) -> list[Span]:
        found = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e["name"] in names)
        if len(found) < (layer + 1) * count:
            raise RingTraceError(f"layer {layer}: the trace has {len(found)} {names[0]} events, too few for cp={cp}")
        return found[layer * count : (layer + 1) * count]

    sends, recvs = ("gloo:send", "nccl:send"), ("gloo:recv", "nccl:recv")  # (NCCL's on GPUs: not tried here)
    return {"block": spans(BLOCK_OPS, cp), "send": spans(sends, cp - 1), "recv": spans(recvs, cp - 1)}


def draw(rings: list[dict[str, list[Span]]], cp: int, layer: int, out: str) -> None:
    import matplotlib  # imported here: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    origin = min(s for ring in rings for spans in ring.values() for s, _ in spans)
    fig, ax = plt.subplots(figsize=(12, 1.2 + 1.0 * len(rings)))
    for rank, ring in enumerate(rings):
        y = len(rings) - 1 - rank  # rank 0 on top
        rows = {"send": (y + 0.22, 0.16), "block": (y - 0.18, 0.36), "recv": (y - 0.4, 0.16)}
        for kind, (bottom, height) in rows.items():
            for step, (start, end) in enumerate(ring[kind]):
                x, width = (start - origin) / 1e3, (end - start) / 1e3
                ax.broken_barh([(x, width)], (bottom, height), color=COLOURS[kind], ec="black", lw=0.3)
                # ring step s: the block uses the kv of cp rank - s; send s passes that kv on to cp rank + 1
                if kind == "block":
                    ax.text(x + width / 2, y, f"kv{(rank % cp - step) % cp}", ha="center", va="center", fontsize=7)
    ax.set_yticks(range(len(rings)))
    ax.set_yticklabels([f"rank {r}" for r in range(len(rings))][::-1], fontsize=8)
    ax.set_xlabel("time from the layer's first event (ms)")
    ax.set_title(
        f"ring attention, layer {layer}'s forward on {cp} ranks: the next key/value chunk is sent and received "
        f"(above, below)\nwhile the block beside it is computed (kvN: the keys and values of cp rank N)",
        fontsize=9,
    )
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLOURS.values()]
    labels = ["attention block (fused kernel)", "send of the kv held", "receive of the next kv"]
    ax.legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.ring_timeline", description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", help="a train_cp.py run folder profiled with --profile-steps")
    parser.add_argument("--out", default=None, help="the PNG to write (default: RUN_DIR/ring_timeline.png)")
    parser.add_argument("--layer", type=int, default=0, help="which attention layer's forward to draw (from 0)")
    args = parser.parse_args(argv)
    try:
        if args.layer < 0:
            raise RingTraceError(f"--layer {args.layer}: layers count from 0")
        cp, traces = load_run(args.run_dir)
        if cp < 2:
            raise RingTraceError(f"{args.run_dir}: cp={cp}; a ring needs at least 2 ranks")
        rings = [ring_spans(events, cp, args.layer) for events in traces]
    except UserError as e:
        fail(str(e))
    out = args.out or os.path.join(args.run_dir, "ring_timeline.png")
    draw(rings, cp, args.layer, out)
    print(f"ring timeline: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
