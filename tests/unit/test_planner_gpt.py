"""The planner for BabyGPT (--model gpt): its FLOPs by the model's sizes (MFU's numerator as PaLM counts it, the
causal kernels' half square), what TP moves for it (the vocabulary-split loss, the sequence-parallel head, the
pipeline's gathered logits, the fp32 residual stream under autocast), a deep model planned at two shallow depths and
extrapolated block by block, and `python -m planner --model gpt` on BabyGPT baby, whose state per rank is the exact
bytes a run holds. The same counted steps against real runs: tests/integration/test_plan_gpt.py."""

from __future__ import annotations

import json

import pytest
import torch

from common.cli import parse_config
from common.config import Config
from common.gpt_sizes import GPT_SIZES
from common.versions import NEEDS_PLANNER
from tests.helpers import needs_torch

pytestmark = needs_torch(NEEDS_PLANNER)

aten = torch.ops.aten


def test_the_model_flops_of_a_step_are_palms_count():
    # MFU's numerator: per token 6 x the parameters a matmul uses (not the embedding's lookup, not the norms) and
    # 12 x depth x seq_len x width for the scores, a full square (Chowdhery et al. 2022, PaLM, appendix B)
    from planner.predict import model_flops_per_step

    for size, seq_len in (("llama3-8b", 8192), ("llama3-405b", 8192), ("baby", 64)):
        shape, vocab = GPT_SIZES[size], GPT_SIZES[size].vocab or 128
        kv = shape.width // shape.heads * shape.kv_heads
        block = 2 * shape.width**2 + 2 * shape.width * kv + 3 * shape.width * shape.mlp
        matmuls = shape.depth * block + shape.width * vocab
        per_token = 6 * matmuls + 12 * shape.depth * seq_len * shape.width
        cfg = Config(model="gpt", model_size=size, seq_len=seq_len, batch_size=3)
        assert model_flops_per_step(cfg) == 3 * seq_len * per_token, size


def test_a_causal_attention_is_counted_as_half_the_square_its_kernels_skip():
    from planner.count import FLOP_FORMULAS
    from planner.predict import gpt_attention_flops, layer_flops

    q = torch.empty(2, 4, 16, 8, device="meta")
    forward = FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu.default.overloadpacket]
    backward = FLOP_FORMULAS[aten._scaled_dot_product_flash_attention_for_cpu_backward.default.overloadpacket]
    lse = torch.empty(2, 4, 16, device="meta")
    full, causal = (forward(q, q, q, 0.0, c, out_val=None) for c in (False, True))
    assert full == 4 * 2 * 4 * 16 * 16 * 8 and causal == full // 2
    full, causal = (backward(q, q, q, q, q, lse, 0.0, c, out_val=None) for c in (False, True))
    assert full == 10 * 2 * 4 * 16 * 16 * 8 and causal == full // 2  # (five matmuls of the scores)
    # the kernels' count per block: the matmuls, half the square forward, backward's five of it halved
    cfg = Config(model="gpt", model_size="small", seq_len=256)
    attention = gpt_attention_flops(cfg)
    assert attention == 4 * 256 * 256 * GPT_SIZES["small"].width
    kernels, model = layer_flops(cfg), layer_flops(cfg, kernels=False)
    matmuls = model["block0"][0] - attention
    assert kernels["block0"] == (matmuls + attention // 2, 2 * matmuls + 5 * attention // 4)
    assert model["block0"] == (matmuls + attention, 2 * (matmuls + attention))  # (the embedding's output needs its
    # gradient: block0's backward is twice its forward, as every block's)
    assert kernels["head"] == model["head"] and kernels["embed"] == model["embed"] == (0, 0)


def gpt(strategy: str, flags: list[str], n: int) -> Config:
    return parse_config(strategy, ["--model", "gpt", "--batch-size", "16", "--seq-len", "32", *flags], world_size=n)


def test_tp_moves_its_layers_sums_and_the_split_losss_three():
    # BabyGPT baby on 2 TP ranks, 16 sequences of 32 tokens (width 64, 2 blocks), fp32: per block q, k, v, gate and
    # up sum their input's gradient and o and down their output; the embedding its output, the head its input's
    # gradient: 16 all-reduces of 16 x 32 x 64 values, 4 bytes each; and the loss on the vocabulary's halves sums,
    # per token, the largest logit, the exponentials and the target's logit (3 x 16 x 32, fp32)
    from planner.predict import traffic

    assert traffic(gpt("tp", [], 2), 2, 0) == {
        "all_reduce": {
            "elements": 16 * 16 * 32 * 64 + 3 * 16 * 32,
            "bytes": 16 * 16 * 32 * 64 * 4 + 3 * 16 * 32 * 4,
            "bytes_sent": 16 * 16 * 32 * 64 * 4 + 3 * 16 * 32 * 4,  # (2 (n - 1) / n = 1 on 2 ranks)
            "bytes_received": 16 * 16 * 32 * 64 * 4 + 3 * 16 * 32 * 4,
        }
    }
    # under bf16's autocast only a linear's output is bf16: o's and down's sums (4 of the 16) take 2 bytes
    sp = traffic(gpt("tp", ["--precision", "bf16"], 2), 2, 0)["all_reduce"]["bytes"]
    assert sp == 12 * 16 * 32 * 64 * 4 + 4 * 16 * 32 * 64 * 2 + 3 * 16 * 32 * 4


# Configurations whose planned step the model's sizes must account for: every collective's bytes as predicted, every
# FLOP as the layers' (with sequence parallel the head's input gathered; a pipeline's last stage gathering its logits)
COUNTED = {
    "tp-sp": ("tp", ["--sequence-parallel"], 2),
    "fsdp-ac": ("fsdp", ["--activation-checkpointing"], 2),
    "pp-x-tp-bf16": ("pippy", ["--tp", "2", "--precision", "bf16"], 4),
}


@pytest.mark.parametrize("name", COUNTED)
def test_the_planned_step_does_the_flops_and_moves_the_bytes_the_sizes_predict(name):
    from planner.measure import plan_rank
    from planner.plan import ranks_to_measure
    from planner.predict import analytic_flops, traffic

    strategy, flags, n = COUNTED[name]
    cfg = gpt(strategy, flags, n)
    for rank in ranks_to_measure(cfg, n):
        count, model = plan_rank(cfg, n, rank, count=True).count, analytic_flops(cfg, n, rank)
        assert count.collective_bytes() == {k: v["bytes"] for k, v in traffic(cfg, n, rank).items()}, rank
        assert count.flops("forward") == model["forward"] > 0, rank
        assert count.flops("backward") == model["backward"] + model["recomputed"], rank


def test_a_deep_model_is_planned_at_two_shallow_depths():
    from planner.plan import blocks_held, shallow_depths, variant_config

    assert shallow_depths(gpt("fsdp", [], 4), 4) == ()  # (baby's 2 blocks: planned whole)
    base = Config(model="gpt", model_size="llama3-405b", seq_len=8192, batch_size=64)
    assert shallow_depths(variant_config("fsdp full, a unit per block", base, 64), 64) == (3, 4)
    cfg = variant_config("pipeline 1f1b", base, 64)  # 4 stages, 16 replicas
    first, second = shallow_depths(cfg, 64)
    assert first == 4 and second >= 8
    ranks = range(4)
    assert sum(blocks_held(cfg, 64, r) for r in ranks) == 126
    from planner.plan import model_depth

    held = []
    for depth in (first, second):
        with model_depth("llama3-405b", depth):
            held.append([blocks_held(cfg, 64, r) for r in ranks])
    assert held[0] == [1, 1, 1, 1] and all(b > a for a, b in zip(*held))  # (every stage's line has two points)


def test_counts_and_collectives_follow_the_line_through_two_depths():
    from planner.count import Collective, Op, StepCount
    from planner.measure import RankMemory
    from planner.plan import _extrapolated

    def step(blocks: int) -> RankMemory:
        count = StepCount(fsdp_units=blocks + 1)
        mm = Op("aten.mm", "forward", 100, 10, calls=2 * blocks, signature="aten.mm.default[]", shapes=((4, 4),))
        adamw = Op(  # a foreach call over every parameter: one call, its bytes grow
            "aten._fused_adamw_", "optimizer", 0, 7 * blocks, calls=1, signature="aten._fused_adamw_.default[]"
        )
        adamw.shapes = ((4, 4),) * blocks
        count.ops = {("mm",): mm, ("adamw", blocks): adamw}
        unit, root = Collective("all_gather", 8, 64, "forward"), Collective("all_gather", 8, 16, "forward")
        stage = Collective("all_gather", 8, 64 * blocks, "backward")  # (gathered once, as big as its blocks)
        count.collectives = [root, *[unit] * blocks, stage]
        count.dtensor_calls["forward", ""] = 5 * blocks
        return RankMemory(0, 10 * blocks, 10 * blocks, 20 * blocks + 4, 100 + 30 * blocks, count=count)

    found = _extrapolated(step(3), step(4), 3, 4, 126)
    assert (found.param_bytes, found.optim_bytes, found.peak_bytes) == (1260, 2524, 100 + 30 * 126)
    count = found.count
    ops = {op.name: op for op in count.ops.values()}
    assert ops["aten.mm"].calls == 252 and (ops["aten._fused_adamw_"].calls, ops["aten._fused_adamw_"].bytes) == (
        1,
        7 * 126,
    )
    sizes = [c.bytes for c in count.collectives]
    assert sizes == [16, *[64] * 126, 64 * 126] and count.fsdp_units == 127
    assert count.dtensor_calls["forward", ""] == 5 * 126


@pytest.mark.parametrize("variant", ["ddp", "fsdp full, a unit per block, checkpointed", "pipeline 1f1b"])
def test_the_extrapolated_plan_is_the_plan_of_every_block(variant):
    # BabyGPT baby made 9 blocks deep: planned at 3 and 4 (a pipeline's 2 stages at 1 and 2 blocks each, ...) and
    # extrapolated, it is what planning all 9 gives: state, peak, FLOPs, collectives (DDP's buckets laid out again)
    from planner.measure import plan_rank
    from planner.plan import measure_ranks, model_depth, ranks_to_measure, shallow_depths, variant_config

    with model_depth("baby", 9):
        cfg = variant_config(variant, Config(model="gpt", model_size="baby", batch_size=16, seq_len=32), 2)
        found, depths = measure_ranks([(cfg, 2)], count=True)[0], shallow_depths(cfg, 2)
        whole = [plan_rank(cfg, 2, rank, count=True) for rank in ranks_to_measure(cfg, 2)]
    assert depths and depths[1] < 9
    for a, b in zip(found, whole):
        assert (a.param_bytes, a.grad_bytes, a.optim_bytes) == (b.param_bytes, b.grad_bytes, b.optim_bytes)
        assert a.peak_bytes == b.peak_bytes and a.count.flops() == b.count.flops()
        assert [c.bytes for c in a.count.collectives] == [c.bytes for c in b.count.collectives]


def test_the_planner_command_holds_the_bytes_a_run_holds(tmp_path, capsys):
    # python -m planner --model gpt on BabyGPT baby (0.1 M parameters, the built-in copy's 128 tokens): per rank the
    # parameters, gradients and AdamW state a run holds, to the byte: 4 bytes a parameter, as many for its gradient,
    # 8 for AdamW's two moments and a 4-byte step counter per tensor; FSDP's rank 0 its rows of each (ceil(rows / 4))
    from common.model import build_model
    from planner.__main__ import main
    from planner.predict import padded_shard

    out = tmp_path / "plan.json"
    variants = "ddp;fsdp full, a unit per block;pipeline 1f1b;fsdp x tp"
    flags = ["--model", "gpt", "--model-size", "baby", "--world-sizes", "1,4", "--variants", variants]
    assert main([*flags, "--jobs", "1", "--json", str(out)]) == 0  # (in this process: no worker started)
    printed = capsys.readouterr().out
    assert "BabyGPT baby: 123,200 parameters; 32 sequence(s) of 64 tokens per rank" in printed
    plans = {(p["variant"], p["world_size"]): p for p in json.loads(out.read_text())}
    model = build_model(model="gpt", size="baby", vocab_size=128, seq_len=64, seed=0)
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert len(shapes) == 21 and sum(torch.Size(s).numel() for s in shapes) == 123_200

    def state(elements: int) -> tuple[int, int, int]:
        return 4 * elements, 4 * elements, 8 * elements + 4 * len(shapes)

    whole, shard = sum(torch.Size(s).numel() for s in shapes), sum(padded_shard(s, 4) for s in shapes)
    expected = {("ddp", 1): whole, ("ddp", 4): whole, ("fsdp full, a unit per block", 4): shard}
    for key, elements in expected.items():
        rank = plans[key]["ranks"][0]
        assert (rank["param_bytes"], rank["grad_bytes"], rank["optim_bytes"]) == state(elements), key
    # TP on 4 ranks: each holds a quarter of every matrix TP splits (the embedding and the output layer by
    # vocabulary, q, k, v, o and SwiGLU's) and the norms whole; a pipeline of 2 stages (the embedding and block0,
    # block1 and the head) over 2 replicas: rank 0 half of the first stage's
    tp = plans["fsdp x tp", 4]["ranks"][0]
    norms = sum(torch.Size(s).numel() for s in shapes if len(s) == 1)
    assert tp["param_bytes"] == 4 * ((whole - norms) // 4 + norms)
    pipeline = plans["pipeline 1f1b", 4]
    first = [tuple(p.shape) for name, p in model.named_parameters() if name.startswith(("embed.", "block0."))]
    assert pipeline["flags"]["dp"] == 2 and pipeline["ranks"][0]["param_bytes"] == 4 * sum(
        padded_shard(s, 2) for s in first
    )


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--seq-len", "128"], "error: --seq-len: a flag of --model gpt"),
        (["--model", "gpt", "--model-size", "baby", "--seq-len", "32768"], "error: --seq-len: 32768 tokens are beyond"),
        (["--model", "gpt", "--published", "gpt-4", "--profile", "h100-sxm"], "error: --published: no published"),
        (["--model", "gpt", "--published"], "error: --published: the published trainings are compared by"),
    ],
)
def test_the_planner_refuses_what_gpt_cannot_plan_in_one_line(flags, said, capsys):
    from planner.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(flags)
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == "" and err.count("\n") == 1 and err.startswith(said), err


def test_each_published_run_is_planned_as_the_scripts_would_start_it():
    # Llama 3's 405B: 16M tokens a step (Table 4: 16M), TP 8 x PP 16 x DP 64 (or 128) = the GPUs; torchtitan's 8B:
    # 2 sequences of 8,192 a GPU
    from planner.report import PUBLISHED
    from runner.layout import would_start

    for item in PUBLISHED:
        for _, flags in item.plans:
            cfg = Config(model="gpt", train_size=flags["batch_size"], **flags)
            assert would_start(cfg, item.world_size, planned=True), item.name
            tokens = cfg.batch_size * cfg.seq_len
            if item.name.startswith("llama3"):
                assert cfg.tp * 16 * cfg.dp == item.world_size and 16e6 < tokens < 17e6, item.name
            else:
                assert tokens == 2 * 8192 * item.world_size, item.name
