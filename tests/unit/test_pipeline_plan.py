"""The pipeline's plan without processes: which flag combinations the checks accept, where each stage lives,
and the bubble simulator against the textbook formula."""

import pytest

from common.cli import parse_config
from common.config import SCHEDULES
from common.pipeline_actions import BALANCED_COST, simulate_bubble
from common.pipeline_layout import PipelineLayout
from common.versions import NEEDS_V
from runner.layout import check_layout
from tests.helpers import PP_PARITY, needs_torch
from tests.integration.test_pippy import DP2, MATRIX, PART1, STAGES_PER_RANK


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


@pytest.mark.parametrize("p,m", [(2, 1), (4, 4), (4, 8), (3, 5)])
def test_simulated_gpipe_and_1f1b_give_the_textbook_bubble(p, m):
    gpipe = [[(r, "F", i) for i in range(m)] + [(r, "B", i) for i in range(m)] for r in range(p)]
    one_f_one_b = []
    for r in range(p):
        warmup = min(p - 1 - r, m)
        order = [(r, "F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [(r, "F", warmup + i), (r, "B", i)]
        one_f_one_b.append(order + [(r, "B", i) for i in range(m - warmup, m)])
    for orders in (gpipe, one_f_one_b):
        assert simulate_bubble(orders, lambda stage, kind: BALANCED_COST[kind]) == pytest.approx((p - 1) / (m + p - 1))
