"""The planner for a mixture of experts (planner/moe.py): Mixtral 8x7B's state per rank, FSDP's unit and the
all-to-alls under FSDP alone and EP x FSDP, against counts by hand; and `python -m planner` on it."""

from __future__ import annotations

import pytest

from planner.__main__ import main
from planner.count import Collective
from planner.moe import MoePlan, moe_plans
from planner.timing import load_profile

# Mixtral 8x7B by hand: per block 8 experts of 3 x 4,096 x 14,336; the rest (attention, router, norms, embedding,
# output layer, final norm) is FSDP's over the world under EP
EXPERT = 3 * 4096 * 14336  # one expert of one layer
EXPERTS = 32 * 8 * EXPERT
TOTAL = 46_702_792_704
DENSE = TOTAL - EXPERTS
BLOCK_DENSE = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 2 * 4096  # attention, router, two norms
ROOT = 2 * 32000 * 4096 + 4096  # embedding, output layer, final norm


def test_state_per_rank_is_every_parameter_over_the_world_under_both():
    for world in (8, 64, 1024):  # the experts over "ep" and "dp" (train_ep.py's dp2ep), the rest over every rank
        fsdp, ep = MoePlan("mixtral-8x7b", world, 0, 4096), MoePlan("mixtral-8x7b", world, 8, 4096)
        assert (fsdp.expert_params, fsdp.dense_params) == (EXPERTS, DENSE)
        assert ep.state_bytes == fsdp.state_bytes == 16 * TOTAL / world
    assert MoePlan("mixtral-8x7b", 64, 8, 4096).state_bytes == 16 * 729_731_136  # 11.68 GB, FSDP alone's
    # what differs is what a rank runs: every expert of a layer gathered whole, or its EP rank's one
    assert MoePlan("mixtral-8x7b", 64, 8, 4096).experts_per_rank == 1
    assert MoePlan("mixtral-8x7b", 64, 0, 4096).experts_per_rank == 8


def test_fsdps_unit_is_a_whole_block_alone_and_under_ep_its_dense_part_and_its_experts_unit():
    block = BLOCK_DENSE + 8 * EXPERT
    assert MoePlan("mixtral-8x7b", 8, 0, 1, "bf16").unit_bytes == block * (2 + 4)  # bf16 weights, fp32 gradients
    # under EP a block's dense part (42 M) and, on 64 ranks (dp 8), its one expert gathered over "dp" (176 M) are
    # smaller than the root's embedding and output layer (262 M); on 8 ranks (dp 1) the experts are not gathered
    assert MoePlan("mixtral-8x7b", 64, 8, 1, "bf16")._experts_gathered() == EXPERT
    assert MoePlan("mixtral-8x7b", 8, 8, 1, "bf16")._experts_gathered() == 0
    assert MoePlan("mixtral-8x7b", 64, 8, 1, "bf16").unit_bytes == ROOT * (2 + 4) > (BLOCK_DENSE + EXPERT) * (2 + 4)
    # 2 EP ranks on 8 (dp 4): a block's dense part and its 4 experts, larger than the root
    assert MoePlan("mixtral-8x7b", 8, 2, 1, "bf16").unit_bytes == (BLOCK_DENSE + 4 * EXPERT) * (2 + 4)


def test_the_collectives_are_fsdps_over_the_world_the_experts_over_dp_and_the_all_to_alls_over_ep():
    ep = MoePlan("mixtral-8x7b", 64, 8, 4096, "bf16")
    assert ep.all_to_alls == 4 * 32 and ep.all_to_all_bytes == 4096 * 2 * 4096 * 2
    assert MoePlan("mixtral-8x7b", 64, 0, 4096).all_to_alls == 0  # FSDP alone: every expert on every rank
    got = {(c.kind, c.group_size, c.bytes, c.first_and_stride): calls for c, calls in ep.collectives()}
    assert got == {
        # the dense parts over the world: a block's gathered for forward and backward, reduce-scattered in fp32
        ("all_gather", 64, BLOCK_DENSE * 2, (0, 1)): 64,
        ("reduce_scatter", 64, BLOCK_DENSE * 4, (0, 1)): 32,
        ("all_gather", 64, ROOT * 2, (0, 1)): 1,
        ("reduce_scatter", 64, ROOT * 4, (0, 1)): 1,
        # each layer's experts unit over "dp": the 8 ranks 8 apart gather its one expert, twice a step (reshard
        # after forward), and reduce-scatter its gradient in fp32; no all-reduce over copies any more
        ("all_gather", 8, EXPERT * 2, (0, 8)): 64,
        ("reduce_scatter", 8, EXPERT * 4, (0, 8)): 32,
        ("all_to_all", 8, 4096 * 2 * 4096 * 2, (0, 1)): 128,
    }
    # ep = world (dp 1): the experts never move, only the tokens
    kinds = [(c.kind, c.first_and_stride) for c, _ in MoePlan("mixtral-8x7b", 8, 8, 4096, "bf16").collectives()]
    assert all(stride == (0, 1) for _, stride in kinds) and ("all_to_all", (0, 1)) in kinds


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


def test_on_64_ranks_eps_all_to_alls_within_a_node_replace_fsdps_gathers_of_every_expert_over_the_world():
    h100 = load_profile("h100-sxm")
    node, network = h100.links["node"], h100.links["network"]

    def timed(n: int, nbytes: int, link: dict, steps: int) -> float:  # an all-gather's or reduce-scatter's
        return steps * link["latency_s"] + nbytes * (n - 1) / n / link["busbw_bytes_per_s"]

    block = BLOCK_DENSE + 8 * EXPERT
    world = lambda nbytes: timed(64, nbytes, network, 12)  # noqa: E731 (64 ranks, 8 nodes: a tree's 12 steps)
    fsdp = 64 * world(block * 2) + 32 * world(block * 4) + world(ROOT * 2) + world(ROOT * 4)
    assert sum(MoePlan("mixtral-8x7b", 64, 0, 4096, "bf16").times(h100).values()) == pytest.approx(fsdp)
    t = MoePlan("mixtral-8x7b", 64, 8, 4096, "bf16").times(h100)
    dense = 64 * world(BLOCK_DENSE * 2) + 32 * world(BLOCK_DENSE * 4) + world(ROOT * 2) + world(ROOT * 4)
    experts = 64 * timed(8, EXPERT * 2, network, 6) + 32 * timed(8, EXPERT * 4, network, 6)  # 8 ranks 8 apart
    a2a = 128 * (6 * node["latency_s"] + 4096 * 2 * 4096 * 2 * 7 / 8 / node["busbw_bytes_per_s"])
    assert t == pytest.approx({"fsdp": dense, "experts": experts, "all_to_all": a2a})
    assert round(fsdp * 1e3, 1) == 7663.2 and round(sum(t.values()) * 1e3, 1) == 1112.5  # 6.9x less
    # the experts' own: each rank gathers its one expert of a layer over 8 ranks, not all 8 over 64: under 1 / ep
    # of FSDP alone's time on the experts (827.8 ms against 7,398.8)
    assert experts < (fsdp - dense) / 8


def test_ep_is_the_largest_that_divides_the_experts_and_the_world():
    plans = moe_plans("mixtral-8x7b", [1, 4, 64, 1024], tokens=4096)
    assert [(p.world_size, p.ep) for p in plans] == [(1, 0), (4, 0), (4, 4), (64, 0), (64, 8), (1024, 0), (1024, 8)]
    deepseek = moe_plans("deepseek-v3-shaped", [1024], tokens=4096)[1]
    assert deepseek.ep == 256 and deepseek.experts_per_rank == 1


def test_python_m_planner_plans_mixtral_under_fsdp_and_ep(capsys):
    assert main(["--model", "gpt", "--model-size", "mixtral-8x7b", "--world-sizes", "8,64", "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "46,702,792,704 parameters" in out and "balanced" in out
    assert f"| ep 8 x fsdp | 64 | 1 | {TOTAL / 64 / 1e9:.3f} B | 11.68 GB |" in out
    assert "| fsdp | 64 | 8 | 0.730 B | 11.68 GB |" in out
