"""Compare runs: loss curves, accuracy, speed and memory of several run folders in one figure and a table.

    python -m tools.compare runs/ref runs/ddp runs/fsdp runs/pippy --out compare.png [--markdown] [--log]

The first run is the reference: the table gives every run's largest per-step |loss - reference loss| and
largest relative |grad_norm - reference grad_norm| (the pre-clip global gradient norm).
Runs whose data set, global batch, seed or model differ are refused (their curves are not comparable);
`--force` compares them anyway and still prints the differences. Reads only metrics.jsonl and run.json.

Beside the figure, compare.png.json (the figure's name with .json added, not in place of .png: `--out
runs/x/run.png` must not overwrite runs/x/run.json) says what it drew, read back from its panels: each panel's
title, its curves (the run each is, its number of points) and its bars per run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

MB = 10**6  # decimal megabytes, the unit `python -m planner` and the docs use (not MiB)
MODEL_NAMES = {"cnn": "BabyCNN", "vit": "BabyViT", "gpt": "BabyGPT"}

# What must agree for two loss curves to be comparable step by step.
MUST_MATCH = {
    "dataset": "data set",
    "train_size": "data set size",
    "test_size": "test set size",
    "batch_size": "global batch",
    "seed": "seed",
    "model": "model",
    "model_size": "model size",
    "patch_size": "model (patch size)",
    "heads": "model (heads)",
    "kv_heads": "model (key/value heads)",
    "seq_len": "sequence length",
    "data_file": "data file",
    "dropout": "model (dropout)",
}


class CompareError(ValueError):
    pass


@dataclass
class Run:
    path: str
    info: dict[str, Any]
    losses: dict[int, float] = field(default_factory=dict)  # step -> train loss
    step_times: dict[int, float] = field(default_factory=dict)  # step -> seconds
    lrs: dict[int, float] = field(default_factory=dict)  # step -> learning rate
    grad_norms: dict[int, float] = field(default_factory=dict)  # step -> pre-clip global gradient norm
    skipped: int | None = None  # fp16: steps skipped because their gradients overflowed (None: not fp16)
    evals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def config(self) -> dict[str, Any]:
        return self.info["config"]

    @property
    def settings(self) -> str:
        """The strategy and the settings that tell its runs apart."""
        c, strategy = self.config, self.info["strategy"]
        parts = [strategy]
        if c.get("allreduce", "builtin") != "builtin":
            parts.append(f"{c['allreduce']} all-reduce")
        if strategy == "fsdp":
            parts.append(c.get("sharding", ""))
        if strategy == "pippy":
            parts.append(f"{c.get('schedule')} m={c.get('n_microbatches')}")
        if strategy in ("pippy", "tp", "cp") and c.get("dp", 1) > 1:
            parts.append(f"dp={c['dp']}")
        if c.get("grad_accum_steps", 1) > 1:
            parts.append(f"accum={c['grad_accum_steps']}")
        if c.get("precision") != "fp32":
            parts.append(c.get("precision", ""))
        return " ".join(p for p in parts if p)

    @property
    def label(self) -> str:
        return f"{os.path.basename(os.path.normpath(self.path))} ({self.settings}, {self.info['world_size']} proc)"

    @property
    def language(self) -> bool:
        """A language model's run (BabyGPT): its throughput is in tokens."""
        return self.config.get("model") == "gpt"

    def tokens_per_s(self) -> float | None:
        """run.json's tokens/s (a language model's: sequences x --seq-len per second), else None."""
        return self.info.get("final", {}).get("tokens_per_s") if self.language else None

    def memory_per_rank(self) -> list[int]:
        return state_bytes_per_rank(self.info)

    def cuda_peak(self) -> int | None:
        peaks = [m.get("cuda_peak_bytes") for m in self.info["memory"]["per_rank"]]
        return max(peaks) if all(p is not None for p in peaks) and peaks else None


def state_bytes_per_rank(run_info: dict[str, Any]) -> list[int]:
    """Parameter + gradient + optimizer-state bytes each rank held, from a run.json."""
    return [m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in run_info["memory"]["per_rank"]]


def load_run(path: str) -> Run:
    run_json, metrics = os.path.join(path, "run.json"), os.path.join(path, "metrics.jsonl")
    for needed in (run_json, metrics):
        if not os.path.exists(needed):
            raise CompareError(f"{path}: no {os.path.basename(needed)} (is this a finished run folder?)")
    with open(run_json) as f:
        run = Run(path, json.load(f))
    with open(metrics) as f:
        for line in f:
            if not line.strip():
                continue
            record = json.loads(line)
            if record["kind"] == "train":
                run.losses[record["step"]] = record["loss"]
                run.step_times[record["step"]] = record["step_time_s"]
                for key, into in (("lr", run.lrs), ("grad_norm", run.grad_norms)):
                    if record.get(key) is not None:  # (hand-written or older files lack them; a skipped step)
                        into[record["step"]] = record[key]
                if "skipped" in record:
                    run.skipped = (run.skipped or 0) + record["skipped"]
            else:
                run.evals.append(record)
    return run


def differences(runs: Sequence[Run]) -> list[str]:
    """One line per setting in MUST_MATCH that differs from the reference (the first run)."""
    lines = []
    for key, what in MUST_MATCH.items():
        ref = runs[0].config.get(key)
        for run in runs[1:]:
            if run.config.get(key) != ref:
                lines.append(
                    f"{what} differs: --{key.replace('_', '-')} {run.config.get(key)} in {run.path} "
                    f"vs {ref} in {runs[0].path}"
                )
    return lines


def max_loss_delta(run: Run, ref: Run) -> float | None:
    """Largest |loss - reference loss| over the steps both runs logged (None if they share none)."""
    common = sorted(set(run.losses) & set(ref.losses))
    return max(abs(run.losses[s] - ref.losses[s]) for s in common) if common else None


def max_grad_norm_delta(run: Run, ref: Run) -> float | None:
    """Largest |grad_norm - reference grad_norm| / reference grad_norm over the steps both runs logged."""
    common = sorted(s for s in set(run.grad_norms) & set(ref.grad_norms) if ref.grad_norms[s])
    return max(abs(run.grad_norms[s] - ref.grad_norms[s]) / ref.grad_norms[s] for s in common) if common else None


def table_rows(runs: Sequence[Run]) -> list[dict[str, Any]]:
    rows = []
    for run in runs:
        final = run.info.get("final", {})
        rows.append(
            {
                "run": os.path.basename(os.path.normpath(run.path)),
                "settings": run.settings,
                "world size": run.info["world_size"],
                "steps": len(run.losses),
                "final train loss": final.get("train_loss"),
                "test accuracy": final.get("test_accuracy"),
                "samples/s": final.get("samples_per_s"),
                **({"tokens/s": run.tokens_per_s()} if runs[0].language else {}),
                "memory/rank (MB)": max(run.memory_per_rank()) / MB,
                "max |Δloss| vs ref": max_loss_delta(run, runs[0]),
                "max rel |Δgrad_norm| vs ref": max_grad_norm_delta(run, runs[0]),
                **({"skipped (fp16)": run.skipped} if any(r.skipped is not None for r in runs) else {}),
                # --profile-steps runs only: the share of collective time that computation hid
                "comm hidden": (run.info.get("profile") or {}).get("comm_hidden_fraction"),
            }
        )
    return rows


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key in ("test accuracy", "comm hidden"):
        return f"{100 * value:.2f}%"
    if key.startswith("max "):
        return f"{value:.1e}"
    if key == "final train loss":
        return f"{value:.4f}"
    if isinstance(value, float):
        return f"{value:.1f}" if key.startswith("memory") else f"{value:.0f}"
    return str(value)


def format_table(rows: list[dict[str, Any]], *, markdown: bool) -> str:
    keys = list(rows[0])
    cells = [[_cell(k, row[k]) for k in keys] for row in rows]
    if markdown:  # a "|" inside a cell must be escaped, or it splits the cell ("max |Δloss| vs ref")
        row = lambda values: "| " + " | ".join(v.replace("|", "\\|") for v in values) + " |"  # noqa: E731
        return "\n".join([row(keys), "|" + "---|" * len(keys), *map(row, cells)])
    widths = [max(len(k), *(len(c[i]) for c in cells)) for i, k in enumerate(keys)]
    line = lambda values: "  ".join(v.ljust(w) for v, w in zip(values, widths))  # noqa: E731
    return "\n".join([line(keys), line(["-" * w for w in widths]), *map(line, cells)])


def plot(runs: Sequence[Run], out: str, *, log_scale: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 4, figsize=(22, 9.5))
    (ax_step, ax_time, ax_acc, ax_lr), (ax_delta, ax_norm, ax_speed, ax_mem) = axes
    ref = runs[0]
    names = [os.path.basename(os.path.normpath(r.path)) for r in runs]
    for i, run in enumerate(runs):
        steps = sorted(run.losses)
        style = {
            "label": run.label,
            "gid": names[i],  # (which run a curve is, for drawn())
            "color": f"C{i}",
            "linewidth": 1.4,
            "alpha": 0.85,
            "linestyle": "-" if i == 0 else "--",
        }
        ax_step.plot(steps, [run.losses[s] for s in steps], **style)
        elapsed, t = [], 0.0
        for s in steps:
            t += run.step_times[s]
            elapsed.append(t)
        ax_time.plot(elapsed, [run.losses[s] for s in steps], **style)
        ax_lr.plot(sorted(run.lrs), [run.lrs[s] for s in sorted(run.lrs)], **style)
        if run.grad_norms:
            ax_norm.plot(sorted(run.grad_norms), [run.grad_norms[s] for s in sorted(run.grad_norms)], **style)
        if run.evals:
            ax_acc.plot(
                [e["step"] for e in run.evals], [100 * e["test_accuracy"] for e in run.evals], marker="o", **style
            )
        if i:
            shared = [s for s in steps if s in ref.losses]
            ax_delta.plot(shared, [max(abs(run.losses[s] - ref.losses[s]), 1e-9) for s in shared], **style)
    ax_step.set(title="training loss per step", xlabel="optimizer step", ylabel="loss (mean over the global batch)")
    ax_time.set(title="training loss against training time", xlabel="seconds (sum of step times)", ylabel="loss")
    scored = "next-token accuracy (%)" if ref.language else "test accuracy (%)"  # a language's: its scored tokens
    ax_acc.set(title="test accuracy at each evaluation", xlabel="optimizer step", ylabel=scored)
    ax_delta.set(
        title=f"|loss - loss of {os.path.basename(os.path.normpath(ref.path))}| per step (equal: drawn at 1e-9)",
        xlabel="optimizer step",
        ylabel="|Δloss|",
        yscale="log",
    )
    ax_lr.set(title="learning rate per step", xlabel="optimizer step", ylabel="lr")
    max_norm = ref.config.get("max_grad_norm")
    ax_norm.set(
        title="global gradient norm before clipping" + (f" (clipped to {max_norm})" if max_norm else ""),
        xlabel="optimizer step",
        ylabel="grad_norm",
    )
    if max_norm:
        ax_norm.axhline(max_norm, color="black", linestyle=":", linewidth=1, gid="max_grad_norm")
    for ax in (ax_step, ax_time):
        if log_scale:
            ax.set_yscale("log")
    colors = [f"C{i}" for i in range(len(runs))]
    language = ref.language  # a language model's throughput in tokens/s, an image model's in samples/s
    speed = [(r.tokens_per_s() if language else r.info["final"]["samples_per_s"]) or 0 for r in runs]
    speeds = ax_speed.bar(names, speed, color=colors)
    for bar, name in zip(speeds, names):
        bar.set_gid(name)  # (which run a bar is, for drawn())
    ax_speed.set(title="training throughput", ylabel="tokens / s" if language else "samples / s")
    width = 0.8 / max(len(r.memory_per_rank()) for r in runs)
    for i, run in enumerate(runs):
        per_rank = run.memory_per_rank()
        for rank, value in enumerate(per_rank):
            ax_mem.bar(
                i - 0.4 + width * (rank + 0.5),
                value / MB,
                width=width * 0.9,
                color=colors[i],
                edgecolor="black",
                linewidth=0.3,
                gid=names[i],
            )
        if run.cuda_peak() is not None:
            peak = [run.cuda_peak() / MB] * 2
            ax_mem.plot([i - 0.4, i + 0.4], peak, color="black", linestyle=":", gid=f"{names[i]} CUDA peak")
    ax_mem.set_xticks(range(len(runs)), names)
    ax_mem.set(
        title="memory per rank: parameters + gradients + optimizer state\n(one bar per rank; dotted: CUDA peak)",
        ylabel="MB (10^6 bytes)",
    )
    for ax in (ax_speed, ax_mem):
        ax.tick_params(axis="x", rotation=20)
    handles, labels = ax_step.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(runs), 3), fontsize=9, frameon=False)
    model = MODEL_NAMES.get(ref.config.get("model", "cnn"), "the model")
    size = ref.config.get("model_size", "baby")
    tokens = f" sequences of {ref.config['seq_len']} tokens" if ref.language else ""
    fig.suptitle(
        f"{model}{'' if size == 'baby' else f' ({size})'} on {ref.config['dataset']}, "
        f"global batch {ref.config['batch_size']}{tokens}, seed {ref.config['seed']}"
    )
    fig.tight_layout(rect=(0, 0.07, 1, 0.97))
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    with open(out + ".json", "w") as f:
        json.dump(drawn(fig), f, indent=1)
    plt.close(fig)


def drawn(fig: Any) -> dict[str, Any]:
    """What the figure shows, read back from its artists (not from what plot() meant to draw): the title, the
    legend, and per panel its title, its y axis' label, its curves ({"name": the run or the line's role, "points"})
    and its bars ({run: how many})."""
    panels = []
    for ax in fig.axes:
        bars: dict[str, int] = {}
        for patch in ax.patches:
            bars[patch.get_gid()] = bars.get(patch.get_gid(), 0) + 1
        curves = [{"name": line.get_gid(), "points": len(line.get_xdata())} for line in ax.get_lines()]
        panels.append({"title": ax.get_title(), "ylabel": ax.get_ylabel(), "curves": curves, "bars": bars})
    legend = [text.get_text() for legend in fig.legends for text in legend.get_texts()]
    return {"title": fig.get_suptitle(), "legend": legend, "panels": panels}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "runs", nargs="+", help="run folders (with metrics.jsonl and run.json); the first is the reference"
    )
    parser.add_argument("--out", default="compare.png", help="where to write the figure (PNG)")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    parser.add_argument("--log", action="store_true", help="log scale for the loss axes")
    parser.add_argument(
        "--force", action="store_true", help="compare runs even if their data, batch, seed or model differ"
    )
    args = parser.parse_args(argv)
    try:
        runs = [load_run(path) for path in args.runs]
        diffs = differences(runs)
        if diffs and not args.force:
            raise CompareError(
                f"runs are not comparable: {diffs[0]}"
                + (f" (and {len(diffs) - 1} more)" if len(diffs) > 1 else "")
                + "; use --force to compare anyway"
            )
    except CompareError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in diffs:
        print(f"warning: {line}", file=sys.stderr)
    print(format_table(table_rows(runs), markdown=args.markdown))
    plot(runs, args.out, log_scale=args.log)
    print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
