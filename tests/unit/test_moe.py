"""The mixture of experts on one process (common/moe.py): the grouped computation against a token-by-token one, the
per-sequence capacity and balance loss against their definitions, the shared expert, EP's regrouping permutation,
and the flags' one-line refusals (common/moe_checks.py). EP on several processes: tests/integration/test_ep.py."""

import math

import pytest
import torch
import torch.nn.functional as F

from common.cli import parse_config
from common.errors import ConfigError
from common.expert_parallel import ExpertParallel
from common.model import build_model
from common.moe import MoE, routed

WIDTH, HIDDEN = 16, 24


def moe(experts=4, top_k=2, shared=False, capacity_factor=0.0, aux_coef=0.01, seed=0) -> MoE:
    torch.manual_seed(seed)
    layer = MoE(WIDTH, HIDDEN, experts=experts, top_k=top_k, shared=shared, capacity_factor=capacity_factor,
                aux_coef=aux_coef, dropout=0.0)  # fmt: skip
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def expert(layer: MoE, e: int, x: torch.Tensor, which: str = "experts") -> torch.Tensor:
    w = getattr(layer, which)
    return (F.silu(x @ w.gate[e]) * (x @ w.up[e])) @ w.down[e]


def by_hand(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: the router's top k of its softmax, renormalised, each expert's SwiGLU weighed by it."""
    out = torch.zeros_like(x)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            probs = (layer.router.weight @ x[b, t]).softmax(-1)
            top, chosen = probs.topk(layer.top_k)
            for w, e in zip(top / top.sum(), chosen.tolist()):
                out[b, t] += w * expert(layer, e, x[b, t])
    return out


def test_the_grouped_experts_compute_what_each_token_would_alone():
    layer, x = moe(), torch.randn(3, 10, WIDTH)
    torch.testing.assert_close(layer(x), by_hand(layer, x), rtol=1e-5, atol=1e-5)
    assert layer.routed.sum() == 3 * 10 * 2 and layer.dropped == 0  # every token to 2 experts, none dropped


def test_the_shared_expert_adds_its_output_for_every_token():
    layer, x = moe(shared=True), torch.randn(2, 6, WIDTH)
    shared = expert(layer, 0, x, "shared")
    torch.testing.assert_close(layer(x), by_hand(layer, x) + shared, rtol=1e-5, atol=1e-5)


def test_capacity_lets_each_sequence_send_an_expert_its_first_assignments_alone():
    layer, x = moe(experts=4, top_k=1, capacity_factor=1.0), torch.randn(2, 12, WIDTH)
    capacity = math.ceil(1.0 * 12 * 1 / 4)  # 3 per sequence and expert
    out = layer(x)
    chosen = F.linear(x, layer.router.weight).argmax(-1)  # top-1: each token's expert
    expected, dropped = torch.zeros_like(x), 0
    for b in range(2):
        seen = [0] * 4
        for t in range(12):
            e = int(chosen[b, t])
            seen[e] += 1
            if seen[e] <= capacity:  # weight 1: one expert, renormalised
                expected[b, t] = expert(layer, e, x[b, t])
            else:
                dropped += 1
    assert dropped > 0 and int(layer.dropped) == dropped  # (this seed routes unevenly enough to drop)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert routed([layer])[0].tolist() == [*torch.bincount(chosen.flatten(), minlength=4).tolist(), dropped]


def test_the_balance_loss_is_the_mean_over_sequences_of_each_ones_balance():
    layer, x = moe(experts=4, top_k=2, aux_coef=0.5), torch.randn(3, 8, WIDTH)
    layer(x)
    per_sequence = []
    for b in range(3):
        probs = (x[b] @ layer.router.weight.T).softmax(-1)  # [T, E]
        counts = torch.bincount(probs.topk(2).indices.flatten(), minlength=4).float()
        per_sequence.append((counts * 4 / (2 * 8) * probs.mean(0)).sum())
    torch.testing.assert_close(layer.aux, 0.5 * torch.stack(per_sequence).mean())
    # the same sequences split in two halves give the same mean: what lets EP's ranks equal one process
    layer(x[:1])
    first = layer.aux
    layer(x[1:])
    torch.testing.assert_close((first + 2 * layer.aux) / 3, 0.5 * torch.stack(per_sequence).mean())


def test_the_regroup_orders_rows_by_expert_then_source():
    received = torch.tensor([[2, 1], [0, 3]])  # rank 0 sent 2 rows for expert 0, 1 for expert 1; rank 1 0 and 3
    # rows arrive as [r0e0, r0e0, r0e1, r1e1, r1e1, r1e1]; expert 0's first, then expert 1's by source
    assert ExpertParallel.regroup(received).tolist() == [0, 1, 2, 3, 4, 5]
    received = torch.tensor([[1, 2], [2, 1]])  # [r0e0, r0e1, r0e1, r1e0, r1e0, r1e1]
    assert ExpertParallel.regroup(received).tolist() == [0, 3, 4, 1, 2, 5]


def test_babygpt_with_experts_has_an_moe_in_each_block_and_the_dense_one_none():
    cfg = parse_config("ddp", ["--model", "gpt", "--experts", "4", "--shared-expert"])
    model = build_model(**cfg.model_kwargs(), vocab_size=128, seq_len=64)
    assert len(model.moes()) == len(model.blocks()) == 2 and cfg.top_k == 2
    assert model.blocks()[0].mlp.experts.gate.shape == (4, 64, 192)  # baby: width 64, each expert as wide as its MLP
    dense = build_model(**parse_config("ddp", ["--model", "gpt"]).model_kwargs(), vocab_size=128, seq_len=64)
    assert dense.moes() == [] and "block0.mlp.gate.weight" in dict(dense.named_parameters())


@pytest.mark.parametrize(
    ("strategy", "flags", "error"),
    [
        ("ddp", ["--model", "gpt", "--top-k", "2"], r"^--top-k: a flag of the mixture of experts.*add --experts"),
        ("ddp", ["--model", "gpt", "--experts", "4", "--top-k", "5"], r"^--top-k: 5 experts per token, of --experts 4"),
        ("ddp", ["--experts", "4"], r"^--experts: a flag of BabyGPT"),
        ("tp", ["--model", "gpt", "--experts", "4"], r"^--experts: train_tp.py does not split a mixture of experts"),
        ("cp", ["--experts", "4"], r"^--experts: train_cp.py does not split"),
        ("ep", ["--experts", "0"], r"^--experts: expert parallelism .* this BabyGPT is dense"),
        ("ep", ["--experts", "6"], r"^--experts: 6 experts do not spread evenly over 4 EP ranks.*--ep 1, 2$"),
        ("ep", ["--ep", "3"], r"^--ep: 3 EP ranks do not divide the world size 4"),
        ("ddp", ["--model", "gpt", "--experts", "4", "--capacity-factor", "-1"], r"^--capacity-factor: must be 0"),
    ],
)
def test_moe_flags_are_refused_in_one_line(strategy, flags, error):
    with pytest.raises(ConfigError, match=error):
        parse_config(strategy, flags, world_size=4)
