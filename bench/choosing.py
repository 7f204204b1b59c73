"""`python -m bench.choosing`: which strategy, when, in one table (docs/choosing.md reads it and says what each column
is). One row per model, size and strategy (MODELS, VARIANTS), planned by the planner's own `plan` on RANKS ranks and
timed on an 8-GPU H100 node; the baby sizes also trained by their runner on CPU_PROCS gloo processes here.

    python -m bench.choosing                  # runs/choosing/{choosing.md,choosing.json}
    python -m bench.choosing --repeats 2      # each CPU run twice, the median and both: ~10 CPU-minutes
    python -m bench.choosing --quick          # BabyCNN baby alone, nothing launched: seconds
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from bench.launches import Parser, launch_and_read
from runner.entry import fail, require_torch

MODELS = {"cnn": ("baby", "large", "7b"), "vit": ("baby", "large", "b16"), "gpt": ("baby", "medium", "llama3-8b")}
NAMES = {"cnn": "BabyCNN", "vit": "BabyViT", "gpt": "BabyGPT"}
FSDP = {"cnn": "fsdp full, a unit per layer"} | dict.fromkeys(("vit", "gpt"), "fsdp full, a unit per block")
VARIANTS = ("ddp", "fsdp", "fsdp x tp", "pipeline 1f1b")
RANKS, PER_RANK, DEVICE_BYTES = 8, 32, 80e9  # one 8-GPU node, the suite's samples per rank, an 80 GB GPU
CPU_PROCS, MEASURED_SIZES = 4, ("baby",)
STEPS, WARMUP = 30, 10  # per CPU run; the first WARMUP steps (allocation, gloo's first rounds) are left out
FLAGS = ("model", "model_size", "batch_size", "sharding", "shard_units", "activation_checkpointing", "schedule")
FLAGS += ("n_microbatches", "dp", "tp", "sequence_parallel")  # the Config fields a variant sets
HEADER = ["model", "size", "parameters", f"strategy on {RANKS} ranks", "state / rank", "peak / rank"]
HEADER += ["sent / rank / step", "H100 step", "MFU", f"CPU samples/s ({CPU_PROCS} gloo)", "fits 80 GB"]


def variant_name(model: str, variant: str) -> str:
    return FSDP[model] if variant == "fsdp" else variant


def layout(cfg: Any, world_size: int) -> str:
    """A variant's layout in a few words: FSDP's units, TP's degree and its FSDP replicas, a pipeline's stages."""
    if cfg.strategy == "fsdp":
        return "FSDP, a unit per " + ("layer" if cfg.model == "cnn" else "block")
    replicas = f" × FSDP {cfg.dp}" if cfg.dp > 1 else ""  # the replicas of TP or of a pipeline shard (FSDP, --dp)
    if cfg.strategy == "tp":
        return f"TP {world_size // cfg.dp}{replicas}"
    return f"1F1B, {world_size // cfg.dp} stages{replicas}" if cfg.strategy == "pippy" else "DDP"


def script_flags(cfg: Any) -> list[str]:
    """The runner's flags that make `cfg` (a variant as the planner configures it), as common/cli.py parses them."""
    args = []
    for name, value in cfg.flags().items():
        flag = "--" + name.replace("_", "-")
        if name in FLAGS:
            args += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    return args


def planned(model: str, size: str, variant: str, profile: Any) -> dict[str, Any]:
    """One row's planned columns: `variant` of the model on RANKS ranks, planned and timed on `profile`."""
    from common.config import Config
    from common.model_sizes import parameter_count
    from planner.plan import plan, ranks_to_measure, variant_config
    from planner.predict import total_bytes, traffic

    name = variant_name(model, variant)
    base = Config(model=model, model_size=size, batch_size=PER_RANK * RANKS)
    p, cfg = plan(name, base, RANKS, profile=profile), variant_config(name, base, RANKS)
    w = p.worst  # the rank that needs the most, as the planner's own table reports it
    sent = max(total_bytes(traffic(cfg, RANKS, rank)) for rank in ranks_to_measure(cfg, RANKS))
    row = dict(model=model, size=size, parameters=parameter_count(size, model=model), variant=name)
    row |= dict(layout=layout(cfg, RANKS), state_bytes=w.state_bytes, peak_bytes=w.peak_bytes, sent_bytes=sent)
    row |= dict(step_s=p.time.step_s, mfu=p.time.mfu, fits=w.peak_bytes + w.in_flight_bytes <= DEVICE_BYTES)
    return row


def measured(model: str, variant: str, out: Path) -> dict[str, Any]:
    """`variant` of the baby model as the planner lays it out on CPU_PROCS ranks, trained STEPS steps by its runner:
    the global batch over the median step after WARMUP."""
    from common.config import Config
    from planner.plan import variant_config

    name, batch = variant_name(model, variant), PER_RANK * CPU_PROCS
    cfg = variant_config(name, Config(model=model, model_size="baby", batch_size=batch), CPU_PROCS)
    folder = out / f"{model}-{variant.replace(' ', '-')}"
    args = [*script_flags(cfg), "--max-steps", str(STEPS), "--epochs", "100", "--train-size", "1024"]
    command = ["bash", f"run_{cfg.strategy}.sh", *args, "--test-size", "128"]
    ran = launch_and_read([*command, "--out", str(folder)], out=folder, nproc=CPU_PROCS, timeout_s=600,
                          warmup=WARMUP, timed=None, batch_size=batch)  # fmt: skip
    found = {"command": f"NPROC={CPU_PROCS} {' '.join(command)}"}
    if "error" in ran:  # the row says so; the table goes on
        return found | {"error": ran["error"]}
    return found | {"samples_per_s": batch / ran["step_time_s"]["median"], "layout": layout(cfg, CPU_PROCS)}


def speed_cell(runs: list[dict[str, Any]]) -> str:
    """The median of the runs' samples/s and, when there are several, each run's: "1,870 (1,820, 1,910)"."""
    speeds = [r["samples_per_s"] for r in runs if "samples_per_s" in r]
    if not speeds:
        return "failed" if runs else "—"
    each = f" ({', '.join(f'{s:,.0f}' for s in speeds)})" if len(speeds) > 1 else ""
    return f"{statistics.median(speeds):,.0f}{each}"


def markdown(rows: list[dict[str, Any]], profile_name: str) -> str:
    from planner.report import size  # MB and GB (10^6, 10^9 bytes), as `python -m planner` prints them

    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    for r in rows:
        cells = [NAMES[r["model"]], f"`{r['size']}`", f"{r['parameters'] / 1e6:,.1f} M", r["layout"]]
        cells += [size(r["state_bytes"]), size(r["peak_bytes"]), size(r["sent_bytes"])]
        cells += [f"{r['step_s'] * 1e3:,.1f} ms", f"{r['mfu']:.1%}", speed_cell(r["cpu_runs"])]
        lines.append("| " + " | ".join([*cells, "yes" if r["fits"] else "no"]) + " |")
    note = f"Planned: {RANKS} ranks, {PER_RANK} samples per rank, AdamW, fp32; step and MFU on {profile_name}, fp32. "
    note += f"CPU: {CPU_PROCS} gloo processes, the planner's layout at {CPU_PROCS} ranks, median step of {WARMUP + 1}"
    return "\n".join([*lines, "", note + f"-{STEPS}; — not run here."]) + "\n"


def parse(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = Parser("python -m bench.choosing", __doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/choosing", help="where choosing.md and choosing.json go")
    parser.add_argument("--profile", default="h100-sxm", help="the GPU the steps are timed on (planner/profiles/)")
    parser.add_argument("--repeats", type=int, default=1, help="launches of each CPU run (the median is shown)")
    parser.add_argument("--quick", action="store_true", help="BabyCNN baby alone, planned, nothing launched")
    args = parser.parse(argv)
    if args.repeats < 1:
        fail(f"--repeats: expected at least 1 launch per CPU run, got {args.repeats}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    from common.errors import ConfigError
    from common.versions import NEEDS_PLANNER
    from planner.timing import load_profile

    require_torch(NEEDS_PLANNER, "python -m bench.choosing")  # it plans every row
    try:
        profile = load_profile(args.profile)
    except ConfigError as e:
        fail(str(e))
    out, started, rows = Path(args.out).resolve(), time.perf_counter(), []
    out.mkdir(parents=True, exist_ok=True)
    models = {"cnn": ("baby",)} if args.quick else MODELS
    for model, sizes in models.items():
        for size_name in sizes:
            for variant in VARIANTS:
                print(f"[choosing] {NAMES[model]} {size_name}: {variant}", file=sys.stderr, flush=True)
                row = planned(model, size_name, variant, profile)
                launches = 0 if args.quick or size_name not in MEASURED_SIZES else args.repeats
                rows.append(row | {"cpu_runs": [measured(model, variant, out) for _ in range(launches)]})
                record = {"profile": profile.name, "rows": rows}  # written row by row: a run cut short keeps them
                (out / "choosing.md").write_text(markdown(rows, profile.name.split(",")[0]))
                (out / "choosing.json").write_text(json.dumps(record, indent=1))
    print((out / "choosing.md").read_text() + f"({len(rows)} rows in {time.perf_counter() - started:.0f} s; {out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
