"""Mutation checks: remove a feature, and the tests that name it must fail. Run by hand (minutes each), not by
pytest or CI:

    python -m tests.mutations                 # every mutation, then a table
    python -m tests.mutations ring resume     # some of them

Each mutation replaces one piece of the sources (it must occur exactly once) in a copy of this checkout, runs the
tests that should notice with `pytest -x`, and reports "caught" if they failed, "MISSED" if they passed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name: (file, what to replace, what with, the tests that must fail)
MUTATIONS: dict[str, tuple[str, str, str, list[str]]] = {
    "ring": (
        "train_ddp.py",
        "model.register_comm_hook(None, comm_hook)",
        "pass  # (not registered)",
        ["tests/integration/test_communication.py", "-k", "ring"],
    ),
    "resume": (
        "common/checkpoint.py",
        "found = resume_point(self.cfg, world_size=dist.get_world_size(), log=self.log)",
        "found = None",
        [
            *("tests/integration/test_resume.py", "tests/integration/test_tp.py", "tests/integration/test_scale.py"),
            *("tests/integration/test_fp16.py", "tests/integration/test_pippy.py", "tests/integration/test_ddp.py"),
            *("-k", "resume or cross or size or move"),
        ],
    ),
    "autocast": (
        "common/training.py",
        'enabled=cfg.precision != "fp32")',
        "enabled=False)",
        ["tests/integration/test_tp.py", "-k", "bf16"],
    ),
    "fsdp-mixed-precision": (  # the root's policy (BabyCNN's only unit by default)
        "train_fsdp.py",
        "param_dtype, mixed.reduce_dtype, output_dtype=",
        "None, mixed.reduce_dtype, output_dtype=",
        ["tests/integration/test_essentials.py", "-k", "bf16_computes"],
    ),
    "fsdp-unit-mixed-precision": (  # the blocks' policy
        "train_fsdp.py",
        "shard = dict(mesh=mesh, mp_policy=mixed, offload_policy=offload_policy)",
        "shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(), offload_policy=offload_policy)",
        ["tests/integration/test_vit.py", "-k", "recomputes"],
    ),
    "compile": (
        "train_ddp.py",
        "model.compile()",
        "pass",
        ["tests/integration/test_essentials.py", "-k", "compiled_runs and ddp"],
    ),
    "compile-stages": (
        "common/pipeline.py",
        "module.forward = torch.compile(module.forward)",
        "pass",
        ["tests/integration/test_essentials.py", "-k", "compiled_runs and pp"],
    ),
    "activation-checkpointing": (
        "train_fsdp.py",
        "model = model if wrapped else checkpoint_wrapper(model)",
        "pass",
        ["tests/integration/test_fsdp.py", "-k", "option and full"],
    ),
    "block-checkpointing": (  # the whole model checkpointed instead of each block
        "train_fsdp.py",
        "wrapped = {id(unit): checkpoint_wrapper(unit) for unit in units if isinstance(unit, nn.Module)}",
        "wrapped = {}",
        ["tests/integration/test_vit.py", "-k", "recomputes"],
    ),
    "cpu-offload": (
        "train_fsdp.py",
        'offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else OffloadPolicy()',
        "offload_policy = OffloadPolicy()",
        ["tests/integration/test_fsdp.py", "-k", "option and grad-op"],
    ),
    "reseeding": (
        "train_ddp.py",
        "torch.manual_seed(cfg.seed + env.rank)",
        "torch.manual_seed(cfg.seed)",
        ["tests/integration/test_ddp.py", "-k", "dropout"],
    ),
    "accumulation-scale": (
        "train_ddp.py",
        "loss = F.cross_entropy(model(x), y) / cfg.grad_accum_steps",
        "loss = F.cross_entropy(model(x), y)",
        ["tests/integration/test_ddp.py", "-k", "accumulation"],
    ),
    "micro-batch-scale": (
        "train_pippy.py",
        "/ (cfg.n_microbatches * cfg.grad_accum_steps)",
        "/ cfg.grad_accum_steps",
        ["tests/integration/test_pippy.py", "-k", "every_schedule"],
    ),
    "weight-decay": (
        "common/training.py",
        "return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=True)",
        "return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, fused=True)",
        ["tests/integration/test_ddp.py", "-k", "weight_decay"],
    ),
    "timeout-line": (
        "common/distributed.py",
        "timed_out = isinstance(e, RuntimeError) and any(m in str(e) for m in GLOO_TIMEOUTS)",
        "timed_out = False",
        ["tests/integration/test_interruptions.py", "-k", "timeout"],
    ),
    "preempt-signal": (
        "common/distributed.py",
        'for sig in (signal.SIGTERM, signal.Signals[f"SIG{preempt_signal}"]):',
        "for sig in (signal.SIGTERM, signal.SIGUSR1):",
        ["tests/integration/test_interruptions.py", "-k", "ctrl_c_then"],
    ),
    "tp-split": (
        "common/model.py",
        "return {name: style() for pair in pairs for name, style in zip(pair, (ColwiseParallel, RowwiseParallel))}",
        "return {}",
        ["tests/integration/test_tp.py", "-k", "slice"],
    ),
    "vit-tp-split": (  # no block split: every TP rank holds the whole model, and still follows one process
        "common/vit.py",
        "        return plan\n",
        "        return {}\n",
        ["tests/integration/test_vit.py", "-k", "share"],
    ),
    "sequence-parallel": (  # the flag ignored: the plain split, which still follows one process
        "train_tp.py",
        "plan = model.tp_plan(cfg.sequence_parallel)",
        "plan = model.tp_plan()",
        ["tests/integration/test_communication.py", "-k", "sp"],
    ),
    "3d-tp": (  # --tp ignored inside the pipeline's stages: every rank holds its stage's whole layers
        "train_pippy.py",
        "dp_mesh=dp, tp_mesh=tp, tp_plan=plan",
        "dp_mesh=dp",
        ["tests/integration/test_vit.py", "-k", "8_processes"],
    ),
}


def copy_checkout(into: Path) -> None:
    """The checkout's files (tracked, and untracked but not ignored) and a link to its .venv."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT, capture_output=True, text=True
    ).stdout.split()
    for name in listed:
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    if (ROOT / ".venv").exists():
        (into / ".venv").symlink_to(ROOT / ".venv")


def run(name: str) -> tuple[str, float]:
    file, old, new, tests = MUTATIONS[name]
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = Path(tmp)
        copy_checkout(copy)
        source = (copy / file).read_text()
        assert source.count(old) == 1, f"{name}: {old!r} occurs {source.count(old)} times in {file}"
        (copy / file).write_text(source.replace(old, new))
        started = time.monotonic()
        env = {**os.environ, "PYTHONPATH": str(copy)}
        done = subprocess.run(
            # (the heavy tier too: a mutation is caught by any test that names it)
            [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "heavy or not heavy", *tests],
            cwd=copy,
            env=env,
            capture_output=True,
            text=True,
        )
        verdict = "caught" if done.returncode != 0 else "MISSED"
        failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
        return f"{verdict}: {failed[0] if failed else done.stdout.strip().splitlines()[-1]}", time.monotonic() - started


def main(names: list[str]) -> None:
    unknown = set(names) - set(MUTATIONS)
    if unknown:
        raise SystemExit(f"error: unknown mutation(s) {', '.join(sorted(unknown))}; choose from {', '.join(MUTATIONS)}")
    results = {}
    for name in names or MUTATIONS:
        results[name] = run(name)
        print(f"{name}: {results[name][0]} ({results[name][1]:.0f} s)", flush=True)
    print("\n| mutation | file | result |\n|---|---|---|")
    for name, (result, _) in results.items():
        print(f"| {name} | {MUTATIONS[name][0]} | {result} |")
    if any(result.startswith("MISSED") for result, _ in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
