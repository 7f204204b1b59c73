"""The pipeline's plan without processes: which flag combinations the checks accept, where each stage lives,
the order each schedule prescribes (what test_pippy.py sets the recorded orders against), and the bubble simulator
against the textbook formula."""

from collections import defaultdict
from itertools import combinations

import pytest

from common.cli import parse_config
from common.config import SCHEDULES
from common.pipeline_actions import BALANCED_COST, simulate_bubble
from common.pipeline_layout import PipelineLayout
from common.versions import NEEDS_V
from runner.layout import check_layout
from tests.helpers import PP_PARITY, needs_torch
from tests.integration.test_pippy import DP2, MATRIX, PART1, STAGES_PER_RANK, TORCH_CLASS, prescribed_orders


@needs_torch(NEEDS_V)  # they name the V schedules and --tp (2.12 both)
def test_every_combination_the_tests_run_passes_the_checks():
    for flags in [*MATRIX.values(), *DP2.values(), PART1]:
        check_layout(parse_config("pippy", [*PP_PARITY, *flags], world_size=4), 4)
    assert set(STAGES_PER_RANK) == set(SCHEDULES)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_stage_placement_covers_every_stage_once(schedule):
    for pp_size in (1, 2, 4):
        layout = PipelineLayout(
            schedule, dp=1, pp_size=pp_size, stages_per_rank=STAGES_PER_RANK[schedule], n_microbatches=8
        )
        held = [stage for rank in range(pp_size) for stage in layout.stages_of(rank)]
        assert sorted(held) == list(range(layout.n_stages))
        assert all(layout.owner(s) == r for r in range(pp_size) for s in layout.stages_of(r))
        # two consecutive stages on one rank: always in a V, and on a pipeline of one rank with several stages
        expected = schedule in ("zbv", "dualpipev") or (pp_size == 1 and layout.n_stages > 1)
        assert layout.local_handoff == expected
    if schedule in ("zbv", "dualpipev"):
        layout = PipelineLayout(schedule, dp=1, pp_size=4, stages_per_rank=2, n_microbatches=8)
        assert layout.owner(7) == 0  # V placement: the last stage, with the loss, is on rank 0


@needs_torch(NEEDS_V)  # (the V schedules' classes)
@pytest.mark.parametrize("m", [4, 8])
def test_every_schedule_prescribes_each_action_once_and_no_two_alike(m):
    """On 4 ranks: each rank runs only the stages the layout gives it, every stage a forward and a backward (or its
    input and weight parts) of every micro-batch once, in an order the simulator can run; no two schedules alike."""
    prescribed = {}
    for schedule, v in STAGES_PER_RANK.items():
        if schedule == "dualpipev" and m < 2 * 4:
            continue  # (it needs as many micro-batches as its 8 stages)
        orders = prescribed[schedule] = prescribed_orders(schedule, p=4, v=v, m=m)
        layout = PipelineLayout(schedule, dp=1, pp_size=4, stages_per_rank=v, n_microbatches=m)
        for rank, order in enumerate(orders):
            assert {stage for stage, _, _ in order} == set(layout.stages_of(rank)), (schedule, rank)
            kinds = defaultdict(str)  # (stage, micro-batch): its actions' kinds
            for stage, kind, mb in order:
                kinds[stage, mb] += kind
            assert set(kinds) == {(stage, mb) for stage in layout.stages_of(rank) for mb in range(m)}
            # a forward, then a full backward or (zero bubble) its input part and later its weight part
            assert set(kinds.values()) <= {"FB", "FIW"}, (schedule, rank)
        assert 0 <= simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]) < 1
    assert set(prescribed) <= set(TORCH_CLASS) and len(prescribed) >= 6
    for a, b in combinations(prescribed, 2):
        assert prescribed[a] != prescribed[b], (a, b)


@pytest.mark.parametrize("p,m", [(2, 1), (4, 4), (4, 8), (3, 5)])
def test_simulated_gpipe_and_1f1b_give_the_textbook_bubble(p, m):
    for schedule in ("gpipe", "1f1b"):
        orders = prescribed_orders(schedule, p=p, v=1, m=m)
        assert simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]) == pytest.approx((p - 1) / (m + p - 1))
