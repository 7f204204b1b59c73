"""What scale costs, measured: every BabyCNN size that fits, trained by DDP, FSDP (full and grad-op, a unit per layer),
the pipeline (1F1B), TP and FSDP x TP (2 x 2) on 4 processes, against what the planner says.

    python -m bench.scale                          # baby .. large, a few minutes each for large: runs/scale/
    python -m bench.scale --sizes baby,small --steps 6

For each run: the memory per rank the planner plans (python -m planner's peak of a step, and the training
state) and what the run measured (run.json: --measure-peak), samples/s over the steps after the first, and the
bytes each rank sends per step, from the model and the mesh (the textbook's ring: an all-reduce sends 2(n-1)/n
of its data, an all-gather or reduce-scatter (n-1)/n; a pipeline stage its activations forward and their
gradients back; TP each layer pair's output and its input's gradient, all-reduced). A run the memory wall
refuses is not launched: the table says so, with what it would need. Writes scale.json, scale.md (the table)
and scale.png (planned against measured, and speed).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench.machine import ROOT, launch_env
from common.config import Config, ConfigError
from common.model_sizes import layers, parameter_count, tp_layer_params, tp_pairs
from runner.memory import MIB_PER_CPU_PROCESS, available_mib, check_memory

VARIANTS = {  # name -> (runner, flags)
    "ddp": ("ddp", []),
    "fsdp full": ("fsdp", ["--sharding", "full", "--shard-units", "blocks"]),
    "fsdp grad-op": ("fsdp", ["--sharding", "grad-op", "--shard-units", "blocks"]),
    "pipeline 1f1b": ("pippy", ["--schedule", "1f1b"]),
    "tp": ("tp", []),
    "fsdp x tp": ("tp", ["--dp", "2"]),
}
NPROC = 4


def bytes_sent(cfg: Config, nproc: int) -> float:
    """What each rank sends per step (the busiest rank of a pipeline), by the textbook's ring."""
    model = layers(cfg.model_size, cfg.dataset)
    params = 4 * sum(layer.params for layer in model)
    ring = (nproc - 1) / nproc
    if cfg.strategy == "ddp":
        return 2 * ring * params  # the gradients' all-reduce
    if cfg.strategy == "fsdp":  # all-gather in forward (and in backward, after a full reshard), reduce-scatter
        return (2 if cfg.sharding == "grad-op" else 3) * ring * params
    if cfg.strategy == "tp":  # per layer pair, an all-reduce of its output in forward, of its input's gradient back
        tp, by_name = nproc // cfg.dp, {layer.name: layer for layer in model}
        inputs = lambda layer: (layer.params - layer.outputs) // layer.outputs  # noqa: E731 (a linear's in_features)
        per_sample = sum(by_name[row].outputs + inputs(by_name[col]) for col, row in tp_pairs(cfg.model_size))
        activations = 2 * (tp - 1) / tp * 4 * (cfg.batch_size // cfg.dp) * per_sample  # the replica's batch
        held = 4 * sum(tp_layer_params(cfg.model_size, tp, cfg.dataset).values())  # FSDP x TP: over the replicas
        return activations + 3 * (cfg.dp - 1) / cfg.dp * held
    from common.pipeline_layout import PipelineLayout

    layout = PipelineLayout.of(cfg, nproc)
    names = [layer.name for layer in model]
    bounds = [names.index(start) for start in layout.stage_starts[1:]]  # where each stage's output crosses over
    crossing = [4 * model[b - 1].outputs for b in bounds]  # fp32 activation of one sample at each boundary
    return 2 * cfg.chunk_size(nproc) * max(crossing, default=0)  # forward, and its gradient back


def plan(cfg: Config) -> dict[str, Any]:
    from planner.measure import plan_rank
    from planner.plan import ranks_to_measure

    ranks = [plan_rank(cfg, NPROC, rank) for rank in ranks_to_measure(cfg, NPROC)]
    return {  # the rank that holds the most of each, as the measured columns take it
        "peak_bytes": max(r.peak_bytes for r in ranks),
        "state_bytes": max(r.state_bytes for r in ranks),
        "in_flight_bytes": max(r.in_flight_bytes for r in ranks),
    }


def run_one(size: str, variant: str, *, out: Path, steps: int) -> dict[str, Any]:
    runner, flags = VARIANTS[variant]
    args = ["--model-size", size, *flags, "--max-steps", str(steps), "--measure-peak", "--log-every", "1"]
    args += ["--train-size", "1024", "--test-size", "128", "--dropout", "0"]
    cfg = Config(strategy=runner, model_size=size)
    for flag, value in zip(flags[::2], flags[1::2]):
        setattr(cfg, flag[2:].replace("-", "_"), int(value) if value.isdigit() else value)
    row: dict[str, Any] = {"size": size, "variant": variant, "parameters": parameter_count(size)}
    row["bytes_sent_per_step"] = bytes_sent(cfg, NPROC)
    row["planned"] = plan(cfg)
    try:
        check_memory(cfg, nproc=NPROC, world_size=NPROC, on_cpu=True)
    except ConfigError as e:  # the memory wall: what the runner would say, without launching
        return {**row, "fits": False, "refused": str(e)}
    folder = out / f"{size}-{variant.replace(' ', '-')}"
    started = time.perf_counter()
    proc = subprocess.run(
        ["bash", f"run_{runner}.sh", *args, "--out", str(folder)],
        cwd=ROOT,
        env=launch_env(NPROC),
        capture_output=True,
        text=True,
    )
    row["wall_s"] = time.perf_counter() - started
    if proc.returncode != 0:
        return {**row, "fits": True, "error": (proc.stderr.strip().splitlines() or ["?"])[-1]}
    info = json.loads((folder / "run.json").read_text())
    records = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if r["kind"] == "train" and r["step"] > 1]  # the first step sets things up
    per_rank = info["memory"]["per_rank"]
    return {
        **row,
        "fits": True,
        "measured_peak_bytes": max(m["peak_bytes"] for m in per_rank),
        "measured_state_bytes": max(m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"] for m in per_rank),
        "samples_per_s": sum(r["samples_per_s"] * r["step_time_s"] for r in timed)
        / sum(r["step_time_s"] for r in timed),
        "command": f"NPROC={NPROC} bash run_{runner}.sh " + " ".join(args),
    }


def gb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e9:.3f}"


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        f"BabyCNN on {NPROC} CPU processes: memory per rank (GB, the rank that needs the most), planned by "
        "python -m planner and measured (--measure-peak), speed, and the bytes each rank sends per step.",
        "",
        "| size | parameters | strategy | state planned | state measured | peak planned | peak measured | "
        "samples/s | sent per step | |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        p = r["planned"]
        note = "" if r.get("fits", True) and not r.get("error") else (r.get("refused") or r.get("error", ""))[:140]
        lines.append(
            f"| {r['size']} | {r['parameters'] / 1e6:.1f} M | {r['variant']} | {gb(p['state_bytes'])} | "
            f"{gb(r.get('measured_state_bytes'))} | {gb(p['peak_bytes'])} | {gb(r.get('measured_peak_bytes'))} | "
            f"{r['samples_per_s']:.0f} | {r['bytes_sent_per_step'] / 1e6:.1f} MB | {note} |"
            if r.get("samples_per_s")
            else f"| {r['size']} | {r['parameters'] / 1e6:.1f} M | {r['variant']} | {gb(p['state_bytes'])} | - | "
            f"{gb(p['peak_bytes'])} | - | - | {r['bytes_sent_per_step'] / 1e6:.1f} MB | does not fit: {note} |"
        )
    return "\n".join(lines) + "\n"


def draw(rows: list[dict[str, Any]], out: Path, *, budget_bytes: float | None) -> None:
    """Planned (o, dashed) and measured (x) peaks per rank; a refused run's plan hollow; the memory a process may
    have here (`budget_bytes`) dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_mem, ax_speed) = plt.subplots(1, 2, figsize=(14, 5))
    for i, variant in enumerate(VARIANTS):
        mine = [r for r in rows if r["variant"] == variant]
        params = [r["parameters"] for r in mine]
        ax_mem.plot(params, [r["planned"]["peak_bytes"] / 1e9 for r in mine], "o--", color=f"C{i}", label=f"{variant}")
        measured = [(r["parameters"], r["measured_peak_bytes"] / 1e9) for r in mine if r.get("measured_peak_bytes")]
        if measured:
            ax_mem.plot(*zip(*measured), "x", color=f"C{i}", markersize=10)
        refused = [(r["parameters"], r["planned"]["peak_bytes"] / 1e9) for r in mine if r.get("fits") is False]
        if refused:
            ax_mem.plot(*zip(*refused), "o", color="white", markeredgecolor=f"C{i}", markersize=12)
        speed = [(r["parameters"], r["samples_per_s"]) for r in mine if r.get("samples_per_s")]
        if speed:
            ax_speed.plot(*zip(*speed), "o-", color=f"C{i}", label=variant)
    if budget_bytes:
        label = "what each of the processes may have here"
        ax_mem.axhline(budget_bytes / 1e9, color="black", linestyle=":", linewidth=1, label=label)
    ax_mem.set(
        xscale="log",
        yscale="log",
        xlabel="parameters",
        ylabel="GB per rank",
        title=f"peak of a step per rank on {NPROC} processes: planned (o--), measured (x), refused (hollow)",
    )
    ax_speed.set(xscale="log", yscale="log", xlabel="parameters", ylabel="samples/s", title="training speed")
    for ax in (ax_mem, ax_speed):
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="baby,small,medium,large")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is left out of samples/s)")
    parser.add_argument("--out", default="runs/scale")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.sizes.split(","):
        for variant in VARIANTS:
            print(f"[scale] {size} {variant} on {NPROC} processes", flush=True)
            rows.append(run_one(size, variant, out=out, steps=args.steps))
            print(f"[scale]   {json.dumps({k: v for k, v in rows[-1].items() if k != 'command'})}", flush=True)
    (out / "scale.json").write_text(json.dumps(rows, indent=1))
    (out / "scale.md").write_text(markdown(rows))
    available = available_mib()
    draw(rows, out / "scale.png", budget_bytes=available and (available / NPROC - MIB_PER_CPU_PROCESS) * 2**20)
    print(markdown(rows))
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}, {out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
