"""A mixture of experts' routing over a run: each expert's share of its layer's tokens, step by step.

    python -m tools.routing RUN_DIR [RUN_DIR ...] [--out FILE.png]

RUN_DIR is a run folder of a model with --experts (train_ep.py writes "tokens_per_expert" [layers][experts] and
"dropped" [layers] in each train record of metrics.jsonl, summed over every rank). The figure: a row per run, a
panel per MoE layer, a line per expert (its share of the layer's assignments), the even share 1 / E dashed. The
table, per run and layer: the most-loaded expert's share over the even share (1.00: balanced; E / k: every token
chose it) at the first step, at its largest and at the last step, and the assignments dropped over capacity in the
whole run (docs/moe.md).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import Any, Sequence

from common.errors import UserError
from runner.entry import fail


class RoutingError(UserError):
    """The run folder has no metrics.jsonl, or its train records have no routing."""


@dataclass
class Routing:
    path: str
    steps: list[int]
    tokens: list[list[list[int]]]  # [step][layer][expert]: assignments routed to each expert (dropped ones too)
    dropped: list[list[int]]  # [step][layer]: assignments over capacity
    config: dict[str, Any]  # run.json's config ({} without run.json)

    @property
    def layers(self) -> int:
        return len(self.tokens[0])

    @property
    def experts(self) -> int:
        return len(self.tokens[0][0])

    def shares(self, layer: int) -> list[list[float]]:
        """[expert][step]: each expert's share of the layer's assignments at each step."""
        rows = [step[layer] for step in self.tokens]
        return [[row[e] / max(sum(row), 1) for row in rows] for e in range(self.experts)]

    def imbalance(self, step: int, layer: int) -> tuple[float, int]:
        """(the most-loaded expert's share over the even share 1 / E, which expert) at the step-th record."""
        row = self.tokens[step][layer]
        top = max(range(len(row)), key=row.__getitem__)
        return row[top] * len(row) / max(sum(row), 1), top


def load_run(run_dir: str) -> Routing:
    """The routing of every train step in RUN_DIR/metrics.jsonl (a step written again after a resume: the last)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    try:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    except OSError as e:
        raise RoutingError(f"{path}: {e.strerror}; RUN_DIR is a run folder (--out of a training script)") from None
    except json.JSONDecodeError as e:
        raise RoutingError(f"{path}: not JSON lines ({e.msg}, line {e.lineno})") from None
    by_step = {r["step"]: r for r in records if r.get("kind") == "train" and "tokens_per_expert" in r}
    if not by_step:
        raise RoutingError(f"{path}: no train record has tokens_per_expert; train_ep.py writes them (--experts)")
    steps = sorted(by_step)
    config: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "run.json")) as f:
            config = json.load(f).get("config", {})
    except (OSError, ValueError):
        pass  # (a run still training has no run.json yet: the title says less)
    tokens = [by_step[s]["tokens_per_expert"] for s in steps]
    dropped = [by_step[s].get("dropped", [0] * len(tokens[0])) for s in steps]
    return Routing(run_dir, steps, tokens, dropped, config)


def table(runs: Sequence[Routing]) -> str:
    """Per run and layer: max share / even share at the first step, at its largest and at the last step, and the
    run's dropped assignments."""
    lines = ["run | layer | max/even, first step | max/even, largest | max/even, last step | dropped"]
    for run in runs:
        first, last = run.steps[0], run.steps[-1]
        for layer in range(run.layers):
            (a, ea), (b, eb) = run.imbalance(0, layer), run.imbalance(-1, layer)
            worst = max(range(len(run.steps)), key=lambda i: run.imbalance(i, layer)[0])  # (the first, on a tie)
            (c, ec), at = run.imbalance(worst, layer), run.steps[worst]
            dropped = sum(step[layer] for step in run.dropped)
            assigned = sum(sum(step[layer]) for step in run.tokens)
            lines.append(
                f"{run.path} | {layer} | {a:.2f} (expert {ea}, step {first}) | {c:.2f} (expert {ec}, step {at}) | "
                f"{b:.2f} (expert {eb}, step {last}) | "
                f"{dropped} of {assigned} ({dropped / max(assigned, 1):.1%})"
            )
    return "\n".join(lines)


def title(run: Routing) -> str:
    c = run.config
    if not c:
        return run.path
    return f"{run.path}: {c.get('experts')} experts, top-{c.get('top_k')}, --aux-loss-coef {c.get('aux_loss_coef')}"


def draw(runs: Sequence[Routing], out: str) -> None:
    import matplotlib  # imported here: only drawing needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = max(run.layers for run in runs)
    fig, axes = plt.subplots(len(runs), cols, figsize=(5.5 * cols, 3.2 * len(runs)), squeeze=False, sharey=True)
    for row, run in enumerate(runs):
        for layer in range(cols):
            ax = axes[row][layer]
            if layer >= run.layers:
                ax.axis("off")
                continue
            for e, share in enumerate(run.shares(layer)):
                ax.plot(run.steps, share, lw=0.9, label=f"expert {e}")
            ax.axhline(1 / run.experts, color="black", ls="--", lw=0.8, label="even share 1/E")
            ax.set_title(f"{title(run)}\nlayer {layer}", fontsize=8)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            if layer == 0:
                ax.set_ylabel("share of the layer's assignments", fontsize=8)
    axes[0][0].set_ylim(bottom=0)
    handles, labels = axes[0][0].get_legend_handles_labels()
    axes[0][-1].legend(handles, labels, fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.routing", description=__doc__.split("\n")[0])
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run folders of a model with --experts")
    parser.add_argument("--out", default=None, help="the PNG to write (default: the first RUN_DIR/routing.png)")
    args = parser.parse_args(argv)
    try:
        runs = [load_run(d) for d in args.run_dirs]
    except UserError as e:
        fail(str(e))
    out = args.out or os.path.join(args.run_dirs[0], "routing.png")
    draw(runs, out)
    print(table(runs))
    print(f"routing: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
