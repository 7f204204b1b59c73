"""What TP costs and buys, measured: the ViT (and BabyCNN beside it) trained by DDP, FSDP, TP with and without
sequence parallel and FSDP x TP on 2 and 4 processes of this machine: samples/s, each rank's memory planned by
python -m planner and measured (--measure-peak), and the bytes each rank sends per step (planner/predict.py).

    python -m bench.tp                               # ViT baby and small, BabyCNN baby: runs/tp/
    python -m bench.tp --models vit:baby --nproc 2,4 --steps 20

Writes tp.json and tp.md (the table docs/tp.md quotes).
"""

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any, Sequence

from bench.launches import failure, launch, read_run_json, records
from bench.report import fmt, md_table
from common.cli import parse_config
from common.versions import NEEDS_PLANNER
from runner.entry import require_torch

VARIANTS = {  # name -> (runner, flags); "sp": --sequence-parallel, the ViT's only
    "ddp": ("ddp", []),
    "fsdp": ("fsdp", ["--shard-units", "blocks"]),
    "tp": ("tp", []),
    "tp sp": ("tp", ["--sequence-parallel"]),
    "fsdp x tp": ("tp", ["--dp", "2"]),
    "fsdp x tp sp": ("tp", ["--dp", "2", "--sequence-parallel"]),
}
TIMEOUT_S = 1800


def run_one(model: str, size: str, variant: str, nproc: int, *, out: Path, steps: int) -> dict[str, Any] | None:
    from planner.measure import plan_rank  # imports torch: not for --help
    from planner.plan import ranks_to_measure
    from planner.predict import total_bytes, traffic

    runner, flags = VARIANTS[variant]
    if (model == "cnn" and "sp" in variant.split()) or ("x" in variant.split() and nproc < 4):
        return None  # no tokens to split; FSDP x TP needs 2 x 2
    args = ["--model", model, "--model-size", size, *flags, "--max-steps", str(steps), "--measure-peak"]
    args += ["--train-size", "2048", "--test-size", "128", "--dropout", "0", "--log-every", "1000"]
    cfg = parse_config(runner, args, world_size=nproc)
    planned = max(plan_rank(cfg, nproc, rank).peak_bytes for rank in ranks_to_measure(cfg, nproc))
    folder = out / f"{model}-{size}-{variant.replace(' ', '-')}-{nproc}"
    shutil.rmtree(folder, ignore_errors=True)  # a previous launch's: the runner would move it aside
    command = ["bash", f"run_{runner}.sh", *args]
    ended = launch([*command, "--out", str(folder)], out=folder, nproc=nproc, timeout_s=TIMEOUT_S)
    row = {"model": f"{model} {size}", "variant": variant, "nproc": nproc, "planned_peak_bytes": planned}
    row |= {"sent_per_step_bytes": max(total_bytes(traffic(cfg, nproc, r)) for r in range(nproc))}
    row["command"] = f"NPROC={nproc} " + " ".join(command)
    if ended["returncode"] != 0:
        return {**row, "error": failure(folder, ended["returncode"])}
    info, timed = read_run_json(folder), [r for r in records(folder) if r["step"] > 2]  # after the measured step
    seconds = sum(r["step_time_s"] for r in timed)
    row["samples_per_s"] = sum(r["samples_per_s"] * r["step_time_s"] for r in timed) / seconds
    row["measured_peak_bytes"] = max(m["peak_bytes"] for m in info["memory"]["per_rank"])
    row["param_bytes"] = max(m["param_bytes"] for m in info["memory"]["per_rank"])
    return row


def markdown(rows: list[dict[str, Any]]) -> str:
    header = ["model", "processes", "strategy", "samples/s", "vs DDP", "parameters per rank", "peak planned"]
    header += ["peak measured", "sent per step"]
    ddp = {(r["model"], r["nproc"]): r.get("samples_per_s") for r in rows if r["variant"] == "ddp"}
    cells, mb = [], lambda n: fmt(n, ".2f", 1e-6)
    for r in rows:
        speed, base = r.get("samples_per_s"), ddp.get((r["model"], r["nproc"]))
        ratio = fmt(speed / base if speed and base else None, ".2f")
        cells.append(
            [r["model"], r["nproc"], r["variant"], fmt(speed, ".0f"), ratio, f"{mb(r.get('param_bytes'))} MB"]
            + [f"{mb(r['planned_peak_bytes'])} MB", f"{mb(r.get('measured_peak_bytes'))} MB"]
            + [f"{mb(r['sent_per_step_bytes'])} MB", r.get("error", "")]
        )
    intro = "Per rank (the one that needs the most): parameters held, the step's peak of tensor memory planned by "
    intro += "python -m planner and measured (--measure-peak), and the bytes it sends per step (planner/predict.py)."
    return "\n".join([intro, "", *md_table([*header, ""], cells)]) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tp", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="vit:baby,vit:small,cnn:baby", help="model:size, comma-separated")
    parser.add_argument("--nproc", default="2,4", help="process counts, comma-separated")
    parser.add_argument("--steps", type=int, default=30, help="steps per run (the first two not timed)")
    parser.add_argument("--out", default="runs/tp")
    args = parser.parse_args(argv)
    require_torch(NEEDS_PLANNER, "python -m bench.tp")  # it plans each run
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for model, _, size in (m.partition(":") for m in args.models.split(",")):
        for nproc in (int(n) for n in args.nproc.split(",")):
            for variant in VARIANTS:
                if row := run_one(model, size, variant, nproc, out=out, steps=args.steps):
                    rows.append(row)
                    print(f"[tp] {json.dumps({k: v for k, v in row.items() if k != 'command'})}", flush=True)
    (out / "tp.json").write_text(json.dumps(rows, indent=1))
    (out / "tp.md").write_text(markdown(rows))
    print(markdown(rows))
    print(f"wrote {out / 'tp.json'}, {out / 'tp.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
