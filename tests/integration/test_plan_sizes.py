"""test_plan.py's checks at the larger sizes, the heavy tier (`pytest -m heavy`): BabyCNN's `small` (12.7 M
parameters) with every variant at 1 to 4 processes, and the ViT at 201.6 M parameters with FSDP on 2 (16 B a
parameter by the rule: 1.6 GB of state per rank, FSDP being what holds it) -- each rank's state to the byte, its
peak within 15 % of the plan, its step's FLOPs and collectives as counted -- and the memory wall's closed form
against the planner for BabyCNN's `small` and `medium` and the 201.6 M ViT (fake tensors, 3 to 28 s a plan)."""

import pytest

from common.versions import NEEDS_PLANNER
from tests.helpers import needs_torch
from tests.integration.test_plan import (
    VARIANTS,
    check_closed_form,
    check_count,
    check_real_runs,
    counted,
    pooled,
)
from tests.integration.test_plan import planned_by as planned_by  # (tests/conftest.py plans ahead with it)

pytestmark = [pytest.mark.heavy, needs_torch(NEEDS_PLANNER)]

PLANNED = {("small", v): VARIANTS[v][2] for v in VARIANTS if not v.startswith("vit")}
PLANNED["medium", "vit-fsdp"] = (2,)
POOLED = pooled(PLANNED)
COUNTED = counted(PLANNED)


@pytest.mark.parametrize("size, variant", PLANNED)
def test_the_plan_is_what_each_rank_of_a_real_run_holds(plans, pool, size, variant):
    check_real_runs(plans, pool / "plan_sizes", size, variant, PLANNED[size, variant])


@pytest.mark.parametrize("name", COUNTED)
def test_the_planned_step_does_the_models_flops_and_moves_the_predicted_bytes(plans, name):
    check_count(plans, name, *COUNTED[name])


@pytest.mark.parametrize("model, size", [("cnn", "small"), ("cnn", "medium"), ("vit", "medium")])
def test_the_closed_form_is_within_25_percent_of_the_planner(plans, model, size):
    check_closed_form(plans, model, size)
