"""The planner's time model on GPUs, nothing launched: its plans (planner/plan.py's time_config on a published profile,
planner/profiles/) beside published measurements (timm on one RTX 3090, NVIDIA NeMo's ViT g/14 on DGX A100 and H100
nodes: PUBLISHED), and each pipeline schedule's bubble on H100. docs/time.md ("At scale") reads both tables.

    python -m bench.at_scale                      # runs/at_scale/at_scale.md (~10 CPU-minutes on 2 cores)
    python -m bench.at_scale --only published     # just the comparison with the published measurements
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

from bench.launches import Parser, fmt, md_table
from common.versions import NEEDS_PLANNER
from runner.entry import require_torch

TIMM = "huggingface/pytorch-image-models results/benchmark-train-amp-nchw-pt112-cu113-rtx3090.csv"
NEMO = "docs.nvidia.com/nemo-framework/user-guide/latest/MultimodalModels/VisionLanguageFoundation/Vit/Perf.html"
# (what, profile, model size, world size, per-GPU batch, precision, optimizer, measured samples/s, source)
PUBLISHED = [
    *(
        ("timm " + name, "rtx3090", size, 1, batch, "fp16", "sgd", speed, TIMM)
        for name, size, batch, speed in (
            ("vit_tiny_patch16_224", "ti16", 512, 2293.54),
            ("vit_small_patch16_224", "s16", 384, 1052.92),
            ("vit_base_patch16_224", "b16", 192, 390.86),
            ("vit_large_patch16_224", "l16", 64, 117.08),
        )
    ),
    *(
        (f"NeMo ViT g/14, {nodes} DGX {gpu.upper()}", f"{gpu}-sxm", "g14", 8 * nodes, 64, "bf16", "adamw", speed, NEMO)
        for gpu, speeds in (("a100", (693, 1347, 2642, 5454, 10644)), ("h100", (1428, 2846, 5737, 11222, 21561)))
        for nodes, speed in zip((1, 2, 4, 8, 16), speeds)
    ),
]


def published(rows_out: list[dict[str, Any]]) -> dict[str, Any]:
    from common.config import Config
    from planner.plan import time_config
    from planner.timing import load_profile

    for what, profile, size, world, batch, precision, optimizer, measured, source in PUBLISHED:
        cfg = Config(strategy="ddp", model="vit", model_size=size, batch_size=batch * world, precision=precision)
        step = time_config(replace(cfg, optimizer=optimizer, train_size=batch * world), world, load_profile(profile))
        row = {"what": what, "profile": profile, "gpus": world, "per_gpu_batch": batch, "precision": precision}
        row |= {"measured": measured, "predicted": step.samples_per_s, "error": step.samples_per_s / measured - 1}
        row |= {"mfu_predicted": step.mfu, "exposed_s": step.exposed_s, "step_s": step.step_s, "source": source}
        rows_out.append(row)
        print(f"[at_scale] {json.dumps(row)}", file=sys.stderr, flush=True)
    errors = [abs(r["error"]) for r in rows_out]
    return {"median_abs_error": statistics.median(errors), "max_abs_error": max(errors)}


def schedules(model: str = "vit", size: str = "g14", batch: int = 64) -> list[dict[str, Any]]:
    """On H100: each pipeline schedule's bubble, 4 stages, 8 micro-batches of `batch` samples (bf16). (What FSDP and
    TP do at scale, python -m planner --profile h100-sxm prints itself.)"""
    from common.config import Config
    from planner.plan import time_config
    from planner.timing import load_profile
    from runner.layout import would_start

    found = []
    for schedule, per_rank in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zbv", 2)):
        base = Config(model=model, model_size=size, precision="bf16", batch_size=8 * batch, strategy="pippy")
        cfg = replace(base, schedule=schedule, stages_per_rank=per_rank, n_microbatches=8, dp=1)
        if would_start(cfg, 4, planned=True):
            step = time_config(cfg, 4, load_profile("h100-sxm"))
            row = {"gpus": 4, "per_gpu_batch": batch * 2, "schedule": schedule, "bubble": step.bubble}
            row |= {k: getattr(step, k) for k in ("step_s", "samples_per_s", "mfu", "communication_s", "exposed_s")}
            found.append(row | {"exposed_share": step.exposed_s / step.step_s if step.step_s else 0.0})
    return found


SCHEDULE_COLUMNS = [  # (title, cell of a schedule's row)
    ("GPUs", lambda r: r["gpus"]),
    ("batch per GPU", lambda r: r["per_gpu_batch"]),
    ("step ms", lambda r: fmt(r["step_s"], ".1f", 1e3)),
    ("samples/s", lambda r: fmt(r["samples_per_s"], ",.0f")),
    ("MFU", lambda r: fmt(r["mfu"], ".0%")),
    ("communication ms", lambda r: fmt(r["communication_s"], ".1f", 1e3)),
    ("exposed ms", lambda r: fmt(r["exposed_s"], ".1f", 1e3)),
    ("exposed", lambda r: fmt(r["exposed_share"], ".0%")),
    ("schedule", lambda r: r["schedule"]),
    ("bubble", lambda r: fmt(r["bubble"], ".0%")),
]
PUBLISHED_COLUMNS = [
    ("system", lambda r: r["what"]),
    ("GPUs", lambda r: r["gpus"]),
    ("batch per GPU", lambda r: r["per_gpu_batch"]),
    ("measured samples/s", lambda r: fmt(r["measured"], ",.0f")),
    ("predicted", lambda r: fmt(r["predicted"], ",.0f")),
    ("error", lambda r: fmt(r["error"], "+.0%")),
    ("predicted MFU", lambda r: fmt(r["mfu_predicted"], ".0%")),
]


def markdown(report: dict[str, Any]) -> str:
    table = lambda columns, rows: md_table([t for t, _ in columns], ([cell(r) for _, cell in columns] for r in rows))
    lines = [f"`{report['command']}`, torch {report['torch']}.", ""]
    if rows := report.get("published"):
        s = report["published_summary"]
        errors = f"median |error| {s['median_abs_error']:.0%}, largest {s['max_abs_error']:.0%}"
        lines += ["## Predicted against published measurements", "", f"{len(rows)} comparisons: {errors}.", ""]
        lines += [*table(PUBLISHED_COLUMNS, rows), ""]
    if rows := report.get("schedules"):
        lines += ["## Schedules", "", *table(SCHEDULE_COLUMNS, rows), ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = Parser("python -m bench.at_scale", __doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("published", "schedules"), help="one half only")
    parser.add_argument("--out", default="runs/at_scale")
    args = parser.parse(argv)
    require_torch(NEEDS_PLANNER, "python -m bench.at_scale")
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python -m bench.at_scale", *(argv if argv is not None else sys.argv[1:])])
    report: dict[str, Any] = {"command": command, "torch": torch.__version__}
    if args.only != "schedules":
        report["published_summary"] = published(report.setdefault("published", []))
    if args.only != "published":
        report["schedules"] = schedules()
    (out / "at_scale.json").write_text(json.dumps(report, indent=1))
    (out / "at_scale.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
