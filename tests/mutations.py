"""Mutation checks: remove a feature, and a test that names it must fail on an assertion. Minutes each:

    python -m tests.mutations                 # every mutation, then a table
    python -m tests.mutations ring resume     # some of them
    python -m tests.mutations --ci            # CI_SUBSET: each strategy and the cross-cutting ones (.ci/run)

Each mutation replaces one piece of the sources (it must occur exactly once) in a copy of this checkout and runs
the tests that should notice, with this module as a pytest plugin (`-p tests.mutations`) that records how each
test ended. "caught": a selected test failed on an assertion in its body (an AssertionError, pytest.fail, a
pytest.raises that saw nothing raised); the run stops there. "ERROR": none did, and something else went wrong: no
test selected, a collection error, an error in a fixture or a shared launch (a mutant whose training crashes is
not caught by the test that reads it), another exception in a test. "MISSED": the selected tests passed. An ERROR
or a MISSED fails the tool (exit 1).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.helpers import CommandFailed

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
    "ddp-bf16": (  # DDP's training forward without autocast: --precision bf16 computes in fp32
        "train_ddp.py",
        'with autocast(cfg, env.device), recorder.span("forward"):',
        'with recorder.span("forward"):',
        ["tests/integration/test_essentials.py", "-k", "ddp_bf16"],
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
        # (fp32 inside the blocks, bf16 handed back to the root, which a plain MixedPrecisionPolicy() would not do:
        # the root's bf16 input then meets fp32 weights and the training crashes instead of being caught)
        "shard = dict(mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32, output_dtype=param_dtype), "
        "offload_policy=offload_policy)",
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
        "loss = (loss_fn(model(x), y) + sum(moe.aux for moe in moes)) / cfg.grad_accum_steps",
        "loss = (loss_fn(model(x), y) + sum(moe.aux for moe in moes))",
        ["tests/integration/test_ddp.py", "-k", "accumulation"],
    ),
    "accumulation-sync-ddp": (  # every chunk's backward all-reduces: the same loss, 4 times the reductions
        "train_ddp.py",
        "with nullcontext() if is_last else model.no_sync():",
        "with nullcontext():",
        ["tests/integration/test_communication.py", "-k", "accumulat and ddp"],
    ),
    "accumulation-sync-fsdp": (  # every chunk's backward reduce-scatters (and HSDP's all-reduces)
        "train_fsdp.py",
        "model.set_requires_gradient_sync(is_last)",
        "model.set_requires_gradient_sync(True)",
        ["tests/integration/test_communication.py", "-k", "accumulat and fsdp and not tp"],
    ),
    "accumulation-sync-tp": (  # FSDP x TP: every chunk's backward reduce-scatters over "dp"
        "train_tp.py",
        "model.set_requires_gradient_sync(i == cfg.grad_accum_steps - 1)",
        "model.set_requires_gradient_sync(True)",
        ["tests/integration/test_communication.py", "-k", "accumulat and tp"],
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
    "tp-split": (  # every linear replicated whole on each TP rank (an empty plan would make apply_tp replicate the
        # root itself, and its nested layers then crash: not a catch)
        "common/model.py",
        "return {name: style() for pair in pairs for name, style in zip(pair, (ColwiseParallel, RowwiseParallel))}",
        'return {name: __import__("train_tp").ReplicateParallel() for pair in pairs for name in pair}',
        ["tests/integration/test_tp.py", "-k", "slice"],
    ),
    "vit-tp-split": (  # no block split: every TP rank holds the whole model, and still follows one process
        "common/vit.py",
        "        return plan\n",
        '        return {n: __import__("train_tp").ReplicateParallel() for n in plan'
        ' if n.rsplit(".", 1)[-1] in "q k v proj fc1 fc2"}\n',
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
    "loss-mean": (  # the logged loss rank 0's own, not the mean over the ranks' shares of the global batch
        "common/training.py",
        "    dist.all_reduce(value, op=dist.ReduceOp.SUM)\n    return value.item() / dist.get_world_size()",
        "    return value.item()",
        ["tests/integration/test_ddp.py", "-k", "four_ranks_match_one_process_adamw"],
    ),
    "rank-slices": (  # every rank trains on rank 0's slice of the global batch
        "common/data.py",
        "return self.global_batch(step)[rank * per_rank : (rank + 1) * per_rank]",
        "return self.global_batch(step)[:per_rank]",
        ["tests/unit/test_model_data_config.py", "tests/integration/test_ddp.py", "-k", "rank_slices or four_ranks"],
    ),
    "clip-fsdp": (  # the sum of squares of a DTensor's gradient not added over the mesh: each rank its shards' norm
        "common/clipping.py",
        "            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)",
        "            pass",
        ["tests/integration/test_essentials.py", "-k", "clipped_runs_match_one_process and fsdp-full"],
    ),
    "clip-tp": (  # the same, seen by TP's clipped run: each rank the norm of its halves of the split layers
        "common/clipping.py",
        "            dist.all_reduce(acc, op=dist.ReduceOp.SUM, group=group)",
        "            pass",
        ["tests/integration/test_vit.py", "-k", "every_strategy_follows_one_process and tp2"],
    ),
    "clip-stages": (  # the pipeline's norm not added over the stages: each stage clips by its own
        "train_pippy.py",
        "grad_norm = clip_grad_norm(params, cfg.max_grad_norm, groups=[pp_group], loss_scale=scaler.value)",
        "grad_norm = clip_grad_norm(params, cfg.max_grad_norm, loss_scale=scaler.value)",
        ["tests/integration/test_vit.py", "-k", "every_strategy_follows_one_process and pp4-1f1b"],
    ),
    "fp16-skip-agreement": (  # each rank skips on the gradients it holds (GradScaler's way), not the global norm
        "common/fp16.py",
        "self.used, self.skipped = self.value, not math.isfinite(grad_norm)",
        "self.used, self.skipped = self.value, any(not (p.grad.to_local() if hasattr(p.grad, 'to_local') else "
        "p.grad).isfinite().all() for g in (optimizer.param_groups if optimizer else []) for p in g['params'] "
        "if p.grad is not None)",
        ["tests/integration/test_fp16.py", "-k", "(skips_the_same_steps and pp-ovf) or one_ranks_overflow"],
    ),
    "reshard-optimizer": (  # a checkpoint of another world size loads the model only: AdamW's moments start over
        "common/checkpoint.py",
        'optimizers = self.optimizers if any(key.startswith("optim.state.") for key in keys) else []',
        'optimizers = self.optimizers if meta["world_size"] == dist.get_world_size() and any('
        'key.startswith("optim.state.") for key in keys) else []',
        ["tests/integration/test_fsdp.py", "-k", "fewer_ranks"],
    ),
    "memory-wall": (  # no run refused, whatever it needs
        "runner/memory.py",
        "    if have is None or total <= have:\n        return\n",
        "    return\n",
        ["tests/unit/test_memory_wall.py"],
    ),
    "memory-wall-preflight": (  # the runners' preflight no longer asks the wall: torchrun starts what cannot fit
        "runner/preflight.py",
        "check_memory(cfg, nproc=per_machine, world_size=min(world_sizes), on_cpu=on_cpu)",
        "pass",
        ["tests/unit/test_preflight.py"],
    ),
    "schedule-gpipe": (  # --schedule gpipe runs 1F1B: the same gradients, another order of actions
        "train_pippy.py",
        '"gpipe": "ScheduleGPipe"',
        '"gpipe": "Schedule1F1B"',
        ["tests/integration/test_pippy.py", "-k", "schedule_that_ran"],
    ),
    "schedule-looped-bfs": (  # --schedule looped-bfs runs interleaved 1F1B
        "train_pippy.py",
        '"looped-bfs": "ScheduleLoopedBFS"',
        '"looped-bfs": "ScheduleInterleaved1F1B"',
        ["tests/integration/test_pippy.py", "-k", "schedule_that_ran"],
    ),
    "schedule-interleaved": (  # --schedule interleaved-1f1b runs looped BFS
        "train_pippy.py",
        '"interleaved-1f1b": "ScheduleInterleaved1F1B"',
        '"interleaved-1f1b": "ScheduleLoopedBFS"',
        ["tests/integration/test_pippy.py", "-k", "schedule_that_ran"],
    ),
    "pipeline-bf16": (  # the pipeline's schedule.step() without autocast: --precision bf16 computes in fp32
        "train_pippy.py",
        "with autocast(cfg, env.device):",
        "with torch.autocast(env.device.type, enabled=False):",
        ["tests/integration/test_pippy.py", "-k", "bf16"],
    ),
    "gpt-pipeline-loss-positions": (  # the pipeline's loss a mean over every position, the unscored included
        # (BabyCNN's 2-D logits: the same mean as before; BabyGPT's copy task: half its loss)
        "train_pippy.py",
        "cross_entropy(logits.float(), labels)",
        'torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum") '
        "/ labels.numel()",
        ["tests/integration/test_gpt_pipeline.py", "-k", "follows_one_process and pp2-1f1b"],
    ),
    "gpt-3d-tp": (  # --tp ignored inside BabyGPT's stages: every rank its stage's whole layers (FSDP's half)
        "train_pippy.py",
        "dp_mesh=dp, tp_mesh=tp, tp_plan=plan",
        "dp_mesh=dp",
        ["tests/integration/test_gpt_pipeline.py", "-k", "8_processes"],
    ),
    "pipeline-eval-padding": (  # evaluation counts the rows that pad the pipeline's last test batch
        "common/training.py",
        "logits, labels = logits[:n_real].float().flatten(0, -2), labels[:n_real].flatten()",
        "logits, labels = logits.float().flatten(0, -2), labels.flatten()",
        ["tests/integration/test_gpt_pipeline.py", "-k", "follows_one_process and pp2-1f1b"],
    ),
    "resume-unreadable": (  # the runner's preflight moves aside a run whose checkpoints' meta.json it cannot read
        "runner/preflight.py",
        "if not meta and not unreadable and move_aside",
        "if not meta and move_aside",
        ["tests/integration/test_ddp.py", "-k", "every_checkpoint_is_damaged"],
    ),
    "gpt-loss-scored": (  # BabyGPT's training loss over every position, the unscored ones as token 0
        "common/training.py",
        "return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1))",
        "return F.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1).clamp(min=0))",
        ["tests/integration/test_gpt.py", "-k", "loss_scores"],
    ),
    "gpt-eval-scored": (  # BabyGPT's evaluation counts every position, scored or not
        "common/training.py",
        "(labels != -100).sum()])",
        "labels.new_tensor(labels.numel())])",
        ["tests/integration/test_gpt.py", "-k", "evaluation_scores"],
    ),
    "fsdp-block-units": (  # --shard-units blocks shards the model as one unit
        "train_fsdp.py",
        'units=model.blocks() if cfg.shard_units == "blocks" else [],',
        "units=[],",
        ["tests/integration/test_gpt.py", "-k", "unit_per_block"],
    ),
    "gpt-logits-gathered": (  # BabyGPT's output layer gathers the logits whole on every TP rank: the loss on them
        "common/gpt.py",
        'out = split if loss_parallel else {"output_layouts": gathered}',
        'out = {"output_layouts": gathered}',
        ["tests/integration/test_gpt_tp.py", "-k", "vocabulary_slice or never_gathered"],
    ),
    "gpt-sequence-parallel": (  # BabyGPT's plan ignores sequence parallel: the plain split, on the same curve
        "common/gpt.py",
        "tokens, gathered = Shard(1), Replicate()",
        "tokens, gathered, sequence_parallel = Shard(1), Replicate(), False",
        ["tests/integration/test_gpt_tp.py", "-k", "vocabulary_slice or never_gathered"],
    ),
    "gpt-tokens": (  # a language model's tokens/s left as its sequences/s
        "common/throughput.py",
        "tokens_per_s = samples_per_s * self.seq_len",
        "tokens_per_s = samples_per_s",
        ["tests/integration/test_gpt_runs.py", "-k", "tokens_per_second"],
    ),
    "gpt-data-file-preflight": (  # the runners' preflight leaves a --data-file to the workers
        "runner/preflight.py",
        "            read_bytes(cfg.data_file)\n",
        "",
        ["tests/integration/test_gpt_runs.py", "-k", "bad_input and (missing or empty or binary)"],
    ),
    "gpt-memory-seq-len": (  # the memory wall plans BabyGPT at 64 tokens whatever --seq-len says
        "runner/memory.py",
        "model = gpt_layers(cfg.model_size, cfg.dataset, cfg.seq_len)",
        "model = gpt_layers(cfg.model_size, cfg.dataset)",
        ["tests/integration/test_gpt_runs.py", "-k", "memory_wall"],
    ),
    "planner-causal": (  # the planner counts a causal attention as the whole square of scores, not its kernels' half
        "planner/count.py",
        "return sdpa_flop_count(query.shape, key.shape, value.shape) // (2 if is_causal else 1)",
        "return sdpa_flop_count(query.shape, key.shape, value.shape)",
        ["tests/unit/test_planner_gpt.py", "-k", "causal or flops_and_moves"],
    ),
    "planner-depths": (  # a deep BabyGPT's plan left at the shallower depth it was planned at, not extrapolated
        "planner/plan.py",
        "    own = [blocks_held(cfg, world_size, rank) for rank in ranks]",
        "    own = held[-1]",
        ["tests/unit/test_planner_gpt.py", "-k", "extrapolated_plan"],
    ),
    "planner-chunks": (  # FSDP's chunks, made one at a time by the planner, each the first rank's
        "planner/shortcuts.py",
        "        start = i * self.rows\n",
        "        start = 0\n",
        ["tests/unit/test_planner_speed.py", "-k", "chunks"],
    ),
    "planner-tp-stand-ins": (  # a pipeline stage's middle TP ranks copied from its first even where its last differs
        "planner/plan.py",
        "            if not all(same_but_rank(",
        "            if False and not all(same_but_rank(",
        ["tests/unit/test_planner_speed.py", "-k", "differ"],
    ),
    "planner-cp-whole-sequences": (  # the planner's CP rank runs its replica's whole sequences, not its two chunks
        "planner/measure.py",
        "x, y = ring.shard(tokens), ring.shard(targets)",
        "x, y = tokens, targets",
        ["tests/unit/test_planner_cp.py", "-k", "divides"],
    ),
    "planner-cp-recompute": (  # the ring's sends counted without a checkpointed block's forward run again
        "planner/predict.py",
        "again = 2 if cfg.activation_checkpointing else 1",
        "again = 1",
        ["tests/unit/test_planner_cp.py", "-k", "counted_sends"],
    ),
    "planner-cp-nothing-hidden": (  # the ring's key/value sends timed as exposed on a GPU too
        "planner/timing.py",
        "hidden = min(kv, attention[phase] * (cp - 1) / cp) if profile.overlap else 0.0",
        "hidden = 0.0",
        ["tests/unit/test_planner_cp.py", "-k", "timed_beside"],
    ),
    "cp-merge-weight": (  # ring attention adds each block's output unweighted: not by its share of the log-sum-exp
        "common/ring_attention.py",
        "+ block_out.float() * (block_lse - merged_lse).exp()[..., None]",
        "+ block_out.float()",
        ["tests/integration/test_cp.py", "-k", "ring_attention_equals"],
    ),
    "cp-blocks": (  # an earlier rank's tail chunk taken for its head: queries meet keys that come after them
        "common/ring_attention.py",
        'return ("all", "head", False) if source < rank else ("tail", "all", False)',
        'return ("all", "tail", False) if source < rank else ("tail", "all", False)',
        ["tests/integration/test_cp.py", "-k", "ring_attention_equals"],
    ),
    "ep-grad-mean": (  # FSDP's own divisor for the experts, the groups' count: their gradients ep x too large
        "train_ep.py",
        "        experts.set_gradient_divide_factor(float(mesh.size()))\n",
        "",
        ["tests/integration/test_ep.py", "-k", "follows_one_process and ep2"],
    ),
    "ep-regroup": (  # the received rows left in source order: a rank's second expert runs the first's tokens
        "common/expert_parallel.py",
        "y = experts(x[by_expert], received.sum(0).tolist())",
        "y = experts(x, received.sum(0).tolist())",
        ["tests/integration/test_ep.py", "-k", "follows_one_process and ep2"],
    ),
    "cp-loss-scale": (  # CP's loss without its x cp: FSDP's average over the ranks then halves the gradient
        "train_cp.py",
        'reduction="sum") * cp / scored',
        'reduction="sum") / scored',
        ["tests/integration/test_cp.py", "-k", "follows_one_process and cp2"],
    ),
    "cp-positions": (  # CP's rotary positions local to each rank's tokens, not their places in the sequence
        "common/gpt.py",
        "positions = self.ring.positions(t, x.device) if self.ring else torch.arange(t, device=x.device)",
        "positions = torch.arange(t, device=x.device)",
        ["tests/integration/test_cp.py", "-k", "follows_one_process and cp2"],
    ),
    "cp-loop-own-mean": (  # the CP loop's loss as each rank's own mean: rank 0, holding unscored positions, weighs more
        "loops/cp.py",
        'reduction="sum") * cp / scored',
        'reduction="sum") / (yc != IGNORE).sum()',
        ["tests/integration/test_copying.py", "-k", "follows_its_one_process_run and cp"],
    ),
    "cp-loop-dkv-home": (  # the CP loop's key/value gradients not sent home after the ring's last step
        "loops/cp.py",
        "            if ring.size > 1:\n                dkv = ring.exchange(dkv)()",
        "            if ring.size > 1 and step < ring.size - 1:\n                dkv = ring.exchange(dkv)()",
        ["tests/integration/test_copying.py", "-k", "follows_its_one_process_run and cp"],
    ),
    "ring-timeline-layer": (  # the ring's figure draws the first layer whatever --layer asks
        "tools/ring_timeline.py",
        "return found[layer * count : (layer + 1) * count]",
        "return found[:count]",
        ["tests/unit/test_ring_timeline.py"],
    ),
    "ring-timeline-step": (  # the ring's figure takes events from outside the profiled step
        "tools/ring_timeline.py",
        'events = [e for e in events if t0 <= e["ts"] <= t1]',
        "pass",
        ["tests/unit/test_ring_timeline.py"],
    ),
}

# What `.ci/run` runs (`--ci`): each strategy (DDP, FSDP, TP, the pipeline) and the cross-cutting features, each
# mutation one whose catching test reads an early, small launch: 7 min on 2 cores (tests/README.md)
CI_SUBSET = (
    *("memory-wall", "memory-wall-preflight", "rank-slices", "timeout-line"),  # (unit tests, one quick launch)
    *("loss-mean", "cpu-offload", "sequence-parallel", "micro-batch-scale"),  # DDP, FSDP, TP, the pipeline
    *("resume", "fp16-skip-agreement", "clip-fsdp"),
    "gpt-logits-gathered",  # BabyGPT: the vocabulary-split loss
    "cp-blocks",  # context parallelism: the ring's head and tail blocks
)

OUTCOMES = "MUTATION_OUTCOMES"  # where the plugin appends each test's outcome, one JSON line each


def _record(**outcome: str) -> None:
    if path := os.environ.get(OUTCOMES):
        with open(path, "a") as f:
            f.write(json.dumps(outcome) + "\n")


def _message(excinfo: pytest.ExceptionInfo | None) -> str:
    return excinfo.exconly().strip().splitlines()[0][:160] if excinfo else ""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """(The plugin's.) A failure in the test's body on an assertion is a catch, and ends the session; a failure
    anywhere else (a fixture, a shared launch, another exception, a command the test runs crashing) is an error."""
    report = (yield).get_result()
    excinfo = call.excinfo
    asserted = excinfo is not None and excinfo.errisinstance((AssertionError, pytest.fail.Exception))
    asserted = asserted and not excinfo.errisinstance(CommandFailed)  # (a command the test needed crashed)
    if report.failed:
        caught = report.when == "call" and asserted
        _record(test=item.nodeid, outcome="failure" if caught else "error", when=report.when, message=_message(excinfo))
        if caught:
            item.session.shouldstop = "a test caught the mutation"
    elif report.when == "call":
        _record(test=item.nodeid, outcome=report.outcome, when="call", message="")


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _record(test=report.nodeid, outcome="error", when="collect", message=str(report.longrepr).splitlines()[-1])


@dataclass
class Result:
    verdict: str  # caught, MISSED or ERROR
    test: str  # the test that caught it, or what went wrong
    seconds: float
    # of every process it started: what it costs the machine, when others share it and stretch `seconds`
    cpu_seconds: float = 0.0


def verdict(outcomes: list[dict], returncode: int, output: str) -> tuple[str, str]:
    """(verdict, the test that caught it or what went wrong) from the plugin's records and pytest's exit status."""
    ended = {kind: [o for o in outcomes if o["outcome"] == kind] for kind in ("failure", "error", "passed")}
    if failure := next(iter(ended["failure"]), None):
        return "caught", f"{failure['test']}: {failure['message']}"
    if error := next(iter(ended["error"]), None):
        return "ERROR", f"{error['test']} (an error in {error['when']}): {error['message']}"
    last = output.strip().splitlines()[-1] if output.strip() else ""
    if not ended["passed"]:
        return "ERROR", f"no test ran (pytest exit {returncode}): {last}"
    if returncode != 0:
        return "ERROR", f"pytest exit {returncode}: {last}"
    return "MISSED", f"the {len(ended['passed'])} selected tests passed"


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


def occurrences(name: str, root: Path = ROOT) -> int:
    file, old, _, _ = MUTATIONS[name]
    return (root / file).read_text().count(old)


def _children_cpu() -> float:
    """The CPU time of the processes this one started that have ended and been waited for."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def _adopt_orphans() -> None:
    """Become the subreaper of what pytest starts (Linux): a launch stopped at the catch is killed whole, torchrun
    with its workers, and the workers, reparented here instead of to init, are waited for, their CPU time counted."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap_orphans(deadline_s: float = 30.0) -> None:
    ends = time.monotonic() + deadline_s
    while time.monotonic() < ends:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                time.sleep(0.1)  # (one still running)
        except ChildProcessError:
            return  # none left


def run(name: str) -> Result:
    file, old, new, tests = MUTATIONS[name]
    started, cpu = time.monotonic(), _children_cpu()
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        copy = Path(tmp)
        copy_checkout(copy)
        if (found := occurrences(name, copy)) != 1:  # (the sources changed since the first check)
            return Result("ERROR", f"the text to replace occurs {found} times in {file}", 0.0)
        (copy / file).write_text((copy / file).read_text().replace(old, new))
        outcomes = copy / "outcomes.jsonl"
        env = {**os.environ, "PYTHONPATH": str(copy), OUTCOMES: str(outcomes)}
        done = subprocess.run(
            # (the heavy tier too: a mutation is caught by any test that names it)
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.mutations"]
            + ["-m", "heavy or not heavy", *tests],
            cwd=copy,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        _reap_orphans()
        records = [json.loads(line) for line in outcomes.read_text().splitlines()] if outcomes.exists() else []
        result = Result(*verdict(records, done.returncode, done.stdout), time.monotonic() - started)
        result.cpu_seconds = _children_cpu() - cpu
        log = Path(tempfile.gettempdir()) / f"mutant-{name}.log"  # all pytest printed
        log.write_text(done.stdout)
        if result.verdict != "caught":  # its end, to see why
            print("\n".join([*done.stdout.strip().splitlines()[-15:], f"(all of it in {log})"]), flush=True)
        return result


def main(args: list[str]) -> None:
    names = list(CI_SUBSET) if args == ["--ci"] else args
    if unknown := [name for name in names if name not in MUTATIONS]:
        raise SystemExit(f"error: unknown mutation(s) {', '.join(unknown)}; choose from {', '.join(MUTATIONS)}")
    names = names or list(MUTATIONS)
    # every text to replace checked first: one the sources no longer hold fails now, not after an hour of others
    if stale := {name: n for name in names if (n := occurrences(name)) != 1}:
        lines = (f"{name}: the text to replace occurs {n} times in {MUTATIONS[name][0]}" for name, n in stale.items())
        raise SystemExit("error: " + "; ".join(lines))
    _adopt_orphans()
    results = {}
    for name in names:
        results[name] = result = run(name)
        print(
            f"{name}: {result.verdict}: {result.test} ({result.seconds:.0f} s, {result.cpu_seconds:.0f} CPU-s)",
            flush=True,
        )
    print("\n| mutation | file | verdict | the test that caught it (or what went wrong) | seconds | CPU-s |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {MUTATIONS[name][0]} | {r.verdict} | {r.test} | {r.seconds:.0f} | {r.cpu_seconds:.0f} |")
    print(
        f"{sum(r.verdict == 'caught' for r in results.values())} of {len(results)} caught, "
        f"{sum(r.seconds for r in results.values()) / 60:.1f} min"
    )
    if any(result.verdict != "caught" for result in results.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main(sys.argv[1:])
