"""The planner for BabyGPT against real runs: every rank of BabyGPT's DDP and FSDP runs (test_gpt.py's, trained once
for both modules: this module adds no training to a whole `pytest`) holds exactly the parameter, gradient and AdamW
bytes the planner plans for it, FSDP's unit per block and its bf16 with every block checkpointed included. What the
planner counts of a GPT step, and its plans of the published shapes: tests/unit/test_planner_gpt.py."""

import pytest

from common.cli import parse_config
from common.versions import NEEDS_PLANNER
from tests.helpers import needs_torch, read_run, tiered
from tests.integration.test_gpt import POOLED as GPT_RUNS

pytestmark = needs_torch(NEEDS_PLANNER)  # every test here plans

POOLED = {name: GPT_RUNS[name] for name in ("ddp2", "ddp4", "fsdp4", "fsdp2-bf16-ac")}


@pytest.mark.parametrize("name", tiered(POOLED, POOLED))  # (DDP on 4 is the heavy tier's)
def test_each_rank_holds_the_planned_state_to_the_byte(pool, name):
    from planner.measure import plan_rank

    run = POOLED[name]
    cfg = parse_config(run.strategy, run.flags, world_size=run.nproc)
    measured = read_run(pool / "plan_gpt" / name)["memory"]["per_rank"]
    assert [r["rank"] for r in measured] == list(range(run.nproc))  # (every rank reported)
    for rank, real in enumerate(measured):
        planned = plan_rank(cfg, run.nproc, rank)
        assert (planned.param_bytes, planned.grad_bytes, planned.optim_bytes) == (
            real["param_bytes"],
            real["grad_bytes"],
            real["optim_bytes"],
        ), (name, rank)
