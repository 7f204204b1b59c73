"""What scale costs, measured: every BabyCNN size that fits, trained by DDP, FSDP (full and grad-op, a unit per layer),
the pipeline (1F1B), TP and FSDP x TP (2 x 2) on 4 processes, against what the planner says.

    python -m bench.scale                          # baby .. large, a few minutes each for large: runs/scale/
    python -m bench.scale --sizes baby,small --steps 6

A run the memory wall refuses is not launched. Writes scale.json, scale.md (the table) and scale.png, which
docs/scale.md reads.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from bench import figures
from bench.launches import failure, launch, read_run_json, records, run_json_facts
from bench.report import fmt, md_table
from common.cli import parse_config
from common.config import Config
from common.errors import ConfigError
from common.model_sizes import layers, parameter_count, tp_layer_params, tp_pairs
from common.pipeline_layout import PipelineLayout
from common.versions import NEEDS_PLANNER
from runner.entry import require_torch
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
TIMEOUT_S = 3600  # per launch: `large` trains at a few samples per second


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
        inputs = lambda layer: (layer.params - layer.outputs) // layer.outputs  # a linear's in_features
        per_sample = sum(by_name[row].outputs + inputs(by_name[col]) for col, row in tp_pairs(cfg.model_size))
        activations = 2 * (tp - 1) / tp * 4 * (cfg.batch_size // cfg.dp) * per_sample  # the replica's batch
        held = 4 * sum(tp_layer_params(cfg.model_size, tp, cfg.dataset).values())  # FSDP x TP: over the replicas
        return activations + 3 * (cfg.dp - 1) / cfg.dp * held
    layout = PipelineLayout.of(cfg, nproc)
    names = [layer.name for layer in model]
    bounds = [names.index(start) for start in layout.stage_starts[1:]]  # where each stage's output crosses over
    crossing = [4 * model[b - 1].outputs for b in bounds]  # fp32 activation of one sample at each boundary
    return 2 * cfg.chunk_size(nproc) * max(crossing, default=0)  # forward, and its gradient back


def run_one(size: str, variant: str, *, out: Path, steps: int) -> dict[str, Any]:
    from planner.measure import plan_rank  # imports torch: not for --help
    from planner.plan import ranks_to_measure

    runner, flags = VARIANTS[variant]
    args = ["--model-size", size, *flags, "--max-steps", str(steps), "--measure-peak", "--log-every", "1"]
    args += ["--train-size", "1024", "--test-size", "128", "--dropout", "0"]
    cfg = parse_config(runner, args, world_size=NPROC)  # as the runner's processes will read the flags
    ranks = [plan_rank(cfg, NPROC, rank) for rank in ranks_to_measure(cfg, NPROC)]
    # planned: the rank that holds the most of each, as the measured columns take it
    planned = {key: max(getattr(r, key) for r in ranks) for key in ("peak_bytes", "state_bytes", "in_flight_bytes")}
    row: dict[str, Any] = {"size": size, "variant": variant, "parameters": parameter_count(size)}
    row |= {"bytes_sent_per_step": bytes_sent(cfg, NPROC), "planned": planned}
    try:
        check_memory(cfg, nproc=NPROC, world_size=NPROC, on_cpu=True)
    except ConfigError as e:  # the memory wall: what the runner would say, without launching
        return {**row, "fits": False, "refused": str(e)}
    folder = out / f"{size}-{variant.replace(' ', '-')}"
    shutil.rmtree(folder, ignore_errors=True)  # a previous launch's: the runner would move it aside, console and all
    command = ["bash", f"run_{runner}.sh", *args]
    ended = launch([*command, "--out", str(folder)], out=folder, nproc=NPROC, timeout_s=TIMEOUT_S)
    row.update(fits=True, wall_s=ended["wall_s"])
    if ended["returncode"] != 0:
        return {**row, "error": failure(folder, ended["returncode"])}
    info, timed = read_run_json(folder), [r for r in records(folder) if r["step"] > 1]  # the first sets things up
    row["measured_peak_bytes"] = max(m["peak_bytes"] for m in info["memory"]["per_rank"])
    row["measured_state_bytes"] = max(run_json_facts(info)["tensor_bytes_per_rank"])
    seconds = sum(r["step_time_s"] for r in timed)
    row["samples_per_s"] = sum(r["samples_per_s"] * r["step_time_s"] for r in timed) / seconds
    return {**row, "command": f"NPROC={NPROC} " + " ".join(command)}


def markdown(rows: list[dict[str, Any]]) -> str:
    header = ["size", "parameters", "strategy", "state planned", "state measured", "peak planned", "peak measured"]
    cells, gb = [], lambda n: fmt(n, ".3f", 1e-9)
    for r in rows:
        planned, speed = r["planned"], r.get("samples_per_s")
        note = "" if speed else f"does not fit: {(r.get('refused') or r.get('error', ''))[:140]}"
        cells.append(
            [r["size"], f"{r['parameters'] / 1e6:.1f} M", r["variant"], gb(planned["state_bytes"])]
            + [gb(r.get("measured_state_bytes")), gb(planned["peak_bytes"]), gb(r.get("measured_peak_bytes"))]
            + [f"{speed:.0f}" if speed else "-", f"{r['bytes_sent_per_step'] / 1e6:.1f} MB", note]
        )
    intro = f"BabyCNN on {NPROC} CPU processes: memory per rank (GB, the rank that needs the most), planned by "
    intro += "python -m planner and measured (--measure-peak), speed, and the bytes each rank sends per step."
    return "\n".join([intro, "", *md_table([*header, "samples/s", "sent per step", ""], cells)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="baby,small,medium,large")
    parser.add_argument("--steps", type=int, default=4, help="steps per run (the first is left out of samples/s)")
    parser.add_argument("--out", default="runs/scale")
    args = parser.parse_args(argv)
    require_torch(NEEDS_PLANNER, "python -m bench.scale")  # it plans each run
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
    budget = available and (available / NPROC - MIB_PER_CPU_PROCESS) * 2**20  # what each process may hold here
    figures.scale(rows, out / "scale.png", nproc=NPROC, budget_bytes=budget)
    print(markdown(rows))
    print(f"wrote {out / 'scale.json'}, {out / 'scale.md'}, {out / 'scale.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
