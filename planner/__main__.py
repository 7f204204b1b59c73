"""`python -m planner`: how much memory each rank needs, per strategy and world size, measured on fake tensors.

    python -m planner --model-size large        # DDP, FSDP and the pipeline at 1, 4, 64 and 1,024 ranks
    python -m planner --model-size 7b --world-sizes 4,64 --device-memory 80GiB
    python -m planner --model-size medium --all --json plan.json --out plan.png
    python -m planner --model vit --model-size b16 --world-sizes 8,64 --profile h100-sxm   # + time per step
    python -m planner --model gpt --model-size llama3-8b --world-sizes 8,64 --profile h100-sxm --precision bf16
    python -m planner --model gpt --published --profile h100-sxm   # beside published Llama 3 trainings
    python -m planner --model gpt --model-size llama3-8b --world-sizes 8 --variants "fsdp full, a unit per block;cp 8" \
        --device-memory 80GiB --longest-sequence                 # the longest sequence each fits

Every figure comes from running the scripts' own wrap and one training step of it, in one process (--jobs of
them at once, the cores by default: planner/jobs.py), on a fake process group of the world size and fake tensors
(planner/measure.py): per rank the parameters, gradients and optimizer state (what run.json reports), and the peak
of the step. Beside them: the textbook's 16 bytes per
parameter (AdamW, fp32), divided by the ranks sharing each parameter. With --profile, the same step counted (its
operators' FLOPs and bytes, its collectives) and timed on that machine (planner/timing.py). How to read the memory:
docs/memory.md; the time: docs/time.md.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from typing import Sequence

from common.config import CHOICES, MODEL_SIZES, MODELS, OPTIMIZERS, Config
from common.errors import ConfigError
from common.gpt_sizes import GPT_SIZES
from common.versions import NEEDS_PLANNER
from common.vit_sizes import VIT_SIZES
from planner.jobs import default_workers
from planner.plan import (
    ALL_VARIANTS,
    CP_VARIANTS,
    DEFAULT_VARIANTS,
    GPT_VARIANTS,
    VIT_VARIANTS,
    Plan,
    plan_all,
    variant_config,
    why_not,
)
from planner.report import (
    PUBLISHED,
    draw,
    fitting,
    longest,
    plan_published,
    published_table,
    table,
    time_table,
)
from runner.entry import fail, require_torch

UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "kb": 10**3, "mb": 10**6, "gb": 10**9}


def parse_bytes(text: str) -> int:
    """80GiB, 24 GiB, 500MB, 1e9 -> bytes."""
    match = re.fullmatch(r"\s*([0-9.e+]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        fail(f"--device-memory: expected a size like 80GiB or 24GB, got {text!r}")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m planner", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="cnn", choices=MODELS, help="cnn (BabyCNN) or vit (BabyViT): --model")
    parser.add_argument(
        "--model-size",
        help="the model's size (--model-size; default large, gpt's medium); the published ViTs at 224 x 224, "
        "gpt's published shapes (gpt2-124m, llama3-8b, llama3-70b, llama3-405b) at their context; a mixture of "
        "experts (mixtral-8x7b, mixtral-8x22b, deepseek-v3-shaped): FSDP against EP x FSDP (planner/moe.py)",
    )
    parser.add_argument("--world-sizes", default="1,4,64,1024", help="comma-separated numbers of ranks")
    parser.add_argument(
        "--all", action="store_true", help="every FSDP mode and the GPipe schedule too; gpt: context parallelism too"
    )
    parser.add_argument(
        "--per-rank-batch",
        type=int,
        help="samples (gpt: sequences) per rank per step: the global batch over the ranks (default 32, the suite's; "
        "gpt's published shapes 1 sequence of --seq-len; CP: sequences per replica, each rank 1/cp of them)",
    )
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="gpt: tokens per sequence (default: 64 for baby, small, medium; a published shape's context: 1,024 for "
        "gpt2-124m, 8,192 for Llama 3)",
    )
    parser.add_argument(
        "--published",
        nargs="?",
        const="all",
        help="gpt: plan published trainings of Llama 3 as they ran (their shape, mesh, batch, sequence) and set the "
        "plans beside what they measured, with the planner's error (needs --profile): all of them, or those named "
        f"({', '.join(p.name for p in PUBLISHED)}, ','-separated)",
    )
    parser.add_argument(
        "--longest-sequence",
        nargs="?",
        type=int,
        const=1024,
        help="gpt, with --device-memory: the longest --seq-len each plan's variant fits at its batch, in multiples "
        "of this many tokens (default 1,024) and of what the variant needs (CP: 2 x cp), each planned on both sides",
    )
    parser.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS)
    parser.add_argument("--device-memory", help="memory of one device (80GiB): which plans fit, the largest batch")
    precisions = CHOICES["precision"][1]
    parser.add_argument("--precision", default="fp32", choices=precisions, help="what the runs compute in")
    parser.add_argument("--variants", help="only these strategy variants, as the table names them, ';'-separated")
    parser.add_argument("--profile", help="also time each step on: h100-sxm, a100-sxm, rtx3090, or a profile file")
    parser.add_argument("--json", help="also write every plan here")
    parser.add_argument("--out", help="also draw the plans into this PNG")
    parser.add_argument(
        "--jobs",
        type=int,
        default=default_workers(),
        help="ranks planned at once, each in a process (default: the cores, up to 8)",
    )
    args = parser.parse_args(argv)
    require_torch(NEEDS_PLANNER, "python -m planner")
    sizes = {"vit": VIT_SIZES, "gpt": GPT_SIZES}.get(args.model, MODEL_SIZES)
    args.model_size = args.model_size or ("medium" if args.model == "gpt" else "large")
    if args.model_size not in sizes:
        fail(f"--model-size: unknown {args.model} size {args.model_size!r}; choose one of {', '.join(sizes)}")
    if args.model != "gpt" and (args.seq_len or args.published):
        fail(f"{'--seq-len' if args.seq_len else '--published'}: a flag of --model gpt, not of {args.model}")
    if args.longest_sequence is not None and (args.model != "gpt" or not args.device_memory):
        fail("--longest-sequence: a question of --model gpt against a --device-memory; give both")
    if args.longest_sequence is not None and args.longest_sequence < 1:
        fail(f"--longest-sequence: expected a number of tokens, 1 or more, got {args.longest_sequence}")
    if args.published and not args.profile:
        fail("--published: the published trainings are compared by their time; give --profile h100-sxm")
    published = args.model == "gpt" and GPT_SIZES[args.model_size].vocab  # a published shape: its own vocabulary
    seq_len = args.seq_len or (GPT_SIZES[args.model_size].context if published else 0)
    per_rank_batch = args.per_rank_batch or (1 if published else 32)
    if per_rank_batch < 1 or seq_len < 0:
        fail(f"--per-rank-batch, --seq-len: expected positive numbers, got {per_rank_batch} and {seq_len}")
    if args.model == "gpt":
        try:  # --seq-len within the shape's context
            Config(model="gpt", model_size=args.model_size, seq_len=seq_len).check_model()
        except ConfigError as e:
            fail(str(e))
    try:
        world_sizes = [int(n) for n in args.world_sizes.split(",")]
        assert all(n >= 1 for n in world_sizes)
    except (ValueError, AssertionError):
        fail(f"--world-sizes: expected numbers of ranks like 1,4,64,1024, got {args.world_sizes!r}")
    if args.jobs < 1:
        fail(f"--jobs: expected a number of processes, 1 or more, got {args.jobs}")
    memory = parse_bytes(args.device_memory) if args.device_memory else None
    profile = None
    if args.profile:
        from planner.timing import load_profile

        try:
            profile = load_profile(args.profile)
        except ConfigError as e:
            fail(str(e))
    started = time.perf_counter()
    if args.model == "gpt" and GPT_SIZES[args.model_size].experts:  # a mixture of experts: FSDP against EP x FSDP
        from planner.moe import moe_plans, moe_table

        if profile and profile.kind != "gpu":
            fail(f"--profile: {profile.name} measured no all-to-all; an MoE's time is planned on a GPU's profile")
        moe = moe_plans(args.model_size, world_sizes, tokens=per_rank_batch * seq_len, precision=args.precision)
        print(moe_table(moe, profile))
        return 0
    if args.published:  # the published trainings, each planned as it ran
        known = {p.name: p for p in PUBLISHED}
        names = list(known) if args.published == "all" else [n.strip() for n in args.published.split(",")]
        if unknown := [n for n in names if n not in known]:
            fail(f"--published: no published training {unknown[0]!r}; choose from {', '.join(known)}")
        items = [known[n] for n in names]
        found = plan_published(items, profile, workers=args.jobs)
        print(published_table(items, found, profile.name))
        print(f"({sum(map(len, found))} plans in {time.perf_counter() - started:.0f} s)")
        return 0
    variants = {"vit": VIT_VARIANTS, "gpt": GPT_VARIANTS + (CP_VARIANTS if args.all else ())}.get(args.model)
    variants = variants or (ALL_VARIANTS if args.all else DEFAULT_VARIANTS)
    known = variants + (CP_VARIANTS if args.model == "gpt" else ())  # (CP's: planned when named, or with --all)
    if args.variants:
        if unknown := [v for v in args.variants.split(";") if v.strip() not in known]:
            name, known = unknown[0].strip(), "; ".join(dict.fromkeys(known))
            fail(f"--variants: no variant {name!r} for --model {args.model}; choose from {known} (';' between them)")
        variants = tuple(v.strip() for v in args.variants.split(";"))
    wanted = [
        (
            variant,
            Config(
                model=args.model,
                model_size=args.model_size,
                optimizer=args.optimizer,
                batch_size=per_rank_batch * n,
                precision=args.precision,
                seq_len=seq_len,
            ),
            n,
        )
        for variant in variants
        for n in world_sizes
    ]
    if args.variants:  # asked for by name: say why one cannot run there, before planning any
        for variant, base, n in wanted:
            if variant_config(variant, base, n) is None:
                fail(f"--world-sizes: {variant} cannot run on {n} ranks: {why_not(variant, base, n)}")

    def planning(variant: str, n: int) -> None:
        print(f"planning {variant} on {n} ranks", file=sys.stderr, flush=True)

    plans: list[Plan] = [p for p in plan_all(wanted, profile=profile, workers=args.jobs, started=planning) if p]
    print(table(plans, args.model, args.model_size, memory=memory))
    if profile:
        print(time_table(plans, f"{profile.name}, {args.precision}"))
    if memory:
        print(fitting(plans, memory, per_rank_batch=per_rank_batch))
    found = []
    if args.longest_sequence:
        said, found = longest(plans, memory, per_rank_batch=per_rank_batch, granule=args.longest_sequence)
        print(said)
    print(f"({len(plans)} plans in {time.perf_counter() - started:.0f} s)")
    if args.json:
        written = [p.to_json() for p in plans]
        for plan, longest_one in zip(written, found):  # (only with --longest-sequence)
            plan["longest_sequence"] = longest_one
        with open(args.json, "w") as f:
            json.dump(written, f, indent=1)
    if args.out:
        draw(plans, args.out, memory=memory)
        print(f"figure: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
