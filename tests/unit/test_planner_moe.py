"""The planner for a mixture of experts (planner/moe.py): Mixtral 8x7B's state per rank, FSDP's unit and the
all-to-alls under FSDP alone and EP x FSDP, against counts by hand; and `python -m planner` on it."""

from __future__ import annotations

import pytest

from planner.__main__ import main
from planner.count import Collective
from planner.moe import MoePlan, moe_plans
from planner.timing import load_profile

# Mixtral 8x7B by hand: per block 8 experts of 3 x 4,096 x 14,336; the rest (attention, router, norms, embedding,
# output layer, final norm) is FSDP's under EP
EXPERTS = 32 * 8 * 3 * 4096 * 14336
TOTAL = 46_702_792_704
DENSE = TOTAL - EXPERTS
BLOCK_DENSE = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096  # attention, router, two norms


def test_state_per_rank_is_the_experts_over_ep_and_the_rest_over_the_world():
    fsdp, ep = MoePlan("mixtral-8x7b", 64, 0, 4096), MoePlan("mixtral-8x7b", 64, 8, 4096)
    assert (fsdp.expert_params, fsdp.dense_params) == (EXPERTS, DENSE)
    assert fsdp.state_bytes == 16 * TOTAL / 64
    assert ep.state_bytes == 16 * (EXPERTS / 8 + DENSE / 64)  # each rank one expert of each layer, 8 copies of all
    assert ep.experts_per_rank == 1 and fsdp.experts_per_rank == 8 / 64
    # on 8 ranks the two hold the same: EP's 8 ranks are one copy of the experts, as FSDP's shards are
    assert MoePlan("mixtral-8x7b", 8, 8, 4096).state_bytes == MoePlan("mixtral-8x7b", 8, 0, 4096).state_bytes


def test_fsdps_unit_is_a_whole_block_alone_and_its_dense_part_under_ep():
    block = BLOCK_DENSE + 8 * 3 * 4096 * 14336
    assert MoePlan("mixtral-8x7b", 8, 0, 1, "bf16").unit_bytes == block * (2 + 4)  # bf16 weights, fp32 gradients
    # under EP a block's dense part (42 M) is smaller than the root's embedding and output layer (262 M)
    root = 2 * 32000 * 4096 + 4096
    assert MoePlan("mixtral-8x7b", 8, 8, 1, "bf16").unit_bytes == root * (2 + 4) > BLOCK_DENSE * (2 + 4)


def test_the_all_to_alls_are_four_a_layer_of_tokens_times_k_rows():
    ep = MoePlan("mixtral-8x7b", 64, 8, 4096, "bf16")
    assert ep.all_to_alls == 4 * 32 and ep.all_to_all_bytes == 4096 * 2 * 4096 * 2
    assert MoePlan("mixtral-8x7b", 64, 0, 4096).all_to_alls == 0  # FSDP alone: every expert on every rank
    collectives = dict((c.kind, (c, calls)) for c, calls in ep.collectives())
    c, calls = collectives["all_to_all"]
    assert (c.group_size, c.bytes, calls) == (8, 4096 * 2 * 4096 * 2, 128)
    # the experts' gradients, fp32, all-reduced over the 8 copies, ranks 8 apart
    c, calls = collectives["all_reduce"]
    assert (c.group_size, c.bytes, c.first_and_stride, calls) == (8, EXPERTS // 8 * 4, (0, 8), 1)


def test_an_all_to_all_is_timed_at_its_links_bus_bandwidth():
    h100 = load_profile("h100-sxm")
    size = 4096 * 2 * 4096 * 2
    # 8 neighbours: one node's NVLink, 7/8 of it leaves each rank; 16 span two nodes: the network
    node, network = h100.links["node"], h100.links["network"]
    inside = h100.collective_time(Collective("all_to_all", 8, size, "forward"))
    assert inside == pytest.approx(6 * node["latency_s"] + size * 7 / 8 / node["busbw_bytes_per_s"])
    across = h100.collective_time(Collective("all_to_all", 16, size, "forward"))
    assert across == pytest.approx(8 * network["latency_s"] + size * 15 / 16 / network["busbw_bytes_per_s"])
    ep = MoePlan("mixtral-8x7b", 64, 8, 4096, "bf16")
    assert ep.times(h100)["all_to_all"] == pytest.approx(128 * inside)


def test_ep_is_the_largest_that_divides_the_experts_and_the_world():
    plans = moe_plans("mixtral-8x7b", [1, 4, 64, 1024], tokens=4096)
    assert [(p.world_size, p.ep) for p in plans] == [(1, 0), (4, 0), (4, 4), (64, 0), (64, 8), (1024, 0), (1024, 8)]
    deepseek = moe_plans("deepseek-v3-shaped", [1024], tokens=4096)[1]
    assert deepseek.ep == 256 and deepseek.experts_per_rank == 1


def test_python_m_planner_plans_mixtral_under_fsdp_and_ep(capsys):
    assert main(["--model", "gpt", "--model-size", "mixtral-8x7b", "--world-sizes", "8,64", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704 parameters" in out and "balanced" in out
    assert f"| ep 8 x fsdp | 64 | 1 | {(EXPERTS / 8 + DENSE / 64) / 1e9:.3f} B |" in out
