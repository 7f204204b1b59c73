"""The memory wall before torchrun starts, on a machine of given memory: one line, and the strategy that fits.
(tests/integration/test_plan.py holds its closed form to the planner.)"""

from dataclasses import replace

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
    check_memory(Config(), nproc=4, world_size=4, on_cpu=True)  # the default run: 4 x ~0.8 GB


def test_the_wall_refuses_a_vit_ddp_cannot_hold(monkeypatch):
    import runner.memory

    monkeypatch.setattr(runner.memory, "available_mib", lambda: 24 * 1024)
    with pytest.raises(ConfigError, match="bash run_fsdp.sh --model vit --model-size large --shard-units blocks"):
        check_memory(Config(model="vit", model_size="large"), nproc=4, world_size=4, on_cpu=True)
    fsdp = Config(model="vit", model_size="large", strategy="fsdp", shard_units="blocks")
    check_memory(fsdp, nproc=4, world_size=4, on_cpu=True)
    check_memory(Config(model="vit"), nproc=4, world_size=4, on_cpu=True)  # the default ViT run


def refusal(cfg: Config, **where) -> str:
    with pytest.raises(ConfigError) as refused:
        check_memory(cfg, **where)
    return str(refused.value).split("; ", 1)[1]  # what it advises, after the need and the memory


def test_the_advice_is_what_helps_that_strategy_on_that_device(monkeypatch):
    import runner.memory

    # one CPU machine: the processes share its memory, so fewer of them help every strategy, DDP's whole copies too
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 8 * 1024)
    ddp = Config(model_size="medium")
    assert refusal(ddp, nproc=8, world_size=8, on_cpu=True) == "this fits (~3.3 GB each): NPROC=2, the same flags"
    check_memory(ddp, nproc=2, world_size=2, on_cpu=True)  # and it does
    pipeline = Config(model_size="medium", strategy="pippy")
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 4 * 1024)
    assert refusal(pipeline, nproc=4, world_size=4, on_cpu=True).endswith("NPROC=2, the same flags")
    check_memory(pipeline, nproc=2, world_size=2, on_cpu=True)
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 12 * 1024)
    fsdp = Config(model_size="large", strategy="fsdp", shard_units="blocks")
    assert refusal(fsdp, nproc=4, world_size=4, on_cpu=True).endswith("NPROC=2, the same flags")
    check_memory(fsdp, nproc=2, world_size=2, on_cpu=True)

    # GPUs: one rank each, so more GPUs shrink a sharded rank's share, never DDP's
    monkeypatch.setattr(runner.memory, "gpu_mib", lambda: 16 * 1024)
    advice = refusal(Config(model_size="7b"), nproc=8, world_size=8, on_cpu=False)
    assert advice.endswith("bash run_fsdp.sh --model-size 7b --shard-units blocks on 16 GPUs (NPROC x NNODES)")
    check_memory(Config(model_size="7b", strategy="fsdp", shard_units="blocks"), nproc=8, world_size=16, on_cpu=False)
    pipeline = Config(model_size="7b", strategy="pippy", n_microbatches=16)  # 16 micro-batches: up to 16 stages
    assert refusal(pipeline, nproc=8, world_size=8, on_cpu=False).endswith("the same flags on 16 GPUs (NPROC x NNODES)")
    check_memory(pipeline, nproc=8, world_size=16, on_cpu=False)
    advice = refusal(replace(pipeline, n_microbatches=8), nproc=8, world_size=8, on_cpu=False)  # 16 stages: no
    assert advice.endswith("--shard-units blocks on 16 GPUs (NPROC x NNODES)")
    monkeypatch.setattr(runner.memory, "gpu_mib", lambda: 1024)  # nothing fits 1 GiB
    advice = refusal(Config(model_size="7b"), nproc=8, world_size=8, on_cpu=False)
    assert advice == "DDP holds the whole model on every GPU, however many: a smaller --batch-size or --model-size"
    assert refusal(Config(model_size="7b", strategy="fsdp"), nproc=8, world_size=8, on_cpu=False).startswith(
        "--activation-checkpointing"
    )
    for strategy in ("ddp", "fsdp", "pippy", "tp"):  # the old advice, wrong for DDP and for any CPU machine
        for on_cpu in (True, False):
            cfg = Config(model_size="7b", strategy=strategy)
            assert "more processes" not in refusal(cfg, nproc=8, world_size=8, on_cpu=on_cpu)
