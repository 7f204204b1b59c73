"""The memory wall before torchrun starts, on a machine of given memory: one line, and the strategy that fits.
(tests/integration/test_plan.py holds its closed form to the planner.)"""

import pytest

from common.config import Config
from common.errors import ConfigError
from runner.memory import check_memory


def test_the_wall_names_what_fits(monkeypatch):
    import runner.memory

    monkeypatch.setattr(runner.memory, "available_mib", lambda: 24 * 1024)  # this machine's kind: 24 GiB
    cfg = Config(model_size="large")
    with pytest.raises(ConfigError, match="bash run_fsdp.sh --model-size large --shard-units blocks") as refused:
        check_memory(cfg, nproc=4, world_size=4, on_cpu=True)
    assert str(refused.value).startswith("--model-size large: DDP on 4 ranks needs 4 processes x")
    check_memory(Config(model_size="large", strategy="fsdp", shard_units="blocks"), nproc=4, world_size=4, on_cpu=True)
    with pytest.raises(ConfigError, match="--shard-units blocks"):  # FSDP gathering the whole model does not fit
        check_memory(Config(model_size="large", strategy="fsdp"), nproc=4, world_size=4, on_cpu=True)
    check_memory(Config(), nproc=4, world_size=4, on_cpu=True)  # the default run: 4 x ~0.7 GiB


def test_the_wall_refuses_a_vit_ddp_cannot_hold(monkeypatch):
    import runner.memory

    monkeypatch.setattr(runner.memory, "available_mib", lambda: 24 * 1024)
    with pytest.raises(ConfigError, match="bash run_fsdp.sh --model vit --model-size large --shard-units blocks"):
        check_memory(Config(model="vit", model_size="large"), nproc=4, world_size=4, on_cpu=True)
    fsdp = Config(model="vit", model_size="large", strategy="fsdp", shard_units="blocks")
    check_memory(fsdp, nproc=4, world_size=4, on_cpu=True)
    check_memory(Config(model="vit"), nproc=4, world_size=4, on_cpu=True)  # the default ViT run
