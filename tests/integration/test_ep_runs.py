"""The mixture of experts through the runners: what run_ep.sh and the other runners refuse before torchrun (one error
line, exit 2, nothing started: the preflight's path, no worker launched), and the memory wall's plan for EP."""

import pytest

import runner.memory
from common.config import Config
from common.errors import ConfigError
from runner.memory import check_memory, planned_peak_bytes
from tests.helpers import env_for_tests, run_command

GPT = ["--model", "gpt"]
BAD_INPUT = [
    # (runner, flags, extra environment, what the line names); NPROC=4 (run_ep.sh: 4 EP ranks)
    ("ep", ["--experts", "6"], {}, "--experts: 6 experts do not spread evenly over 4 EP ranks"),
    ("ep", ["--top-k", "9"], {}, "--top-k: 9 experts per token, of --experts 8"),  # (train_ep.py's 8 experts)
    ("ep", ["--experts", "0"], {}, "--experts: expert parallelism spreads a mixture of experts"),  # dense
    ("ep", ["--ep", "3"], {}, "--ep: 3 EP ranks do not divide the world size 4"),
    ("ep", ["--model", "cnn"], {}, "--model: expert parallelism spreads BabyGPT's experts; use --model gpt"),
    ("ep", [], {"NNODES": "1:2", "MASTER_ADDR": "127.0.0.1"}, "elastic training is supported by run_ddp.sh"),
    ("ddp", [*GPT, "--top-k", "2"], {}, "--top-k: a flag of the mixture of experts, and this model is dense"),
    ("ddp", ["--experts", "4"], {}, "--experts: a flag of BabyGPT (--model gpt), not of the cnn"),
    ("tp", [*GPT, "--experts", "4"], {}, "--experts: train_tp.py does not split a mixture of experts"),
    ("cp", ["--experts", "4"], {}, "--experts: train_cp.py does not split a mixture of experts"),
]


@pytest.mark.parametrize("strategy, flags, env, named", BAD_INPUT, ids=[f"{b[0]}{i}" for i, b in enumerate(BAD_INPUT)])
def test_bad_input_is_one_line_before_torchrun(tmp_path, strategy, flags, env, named):
    out = tmp_path / "out"
    proc = run_command(
        ["bash", f"run_{strategy}.sh", *flags, "--out", str(out)],
        env={**env_for_tests(), "NPROC": "4", **env},
        check=False,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stdout == "" and not out.exists(), proc.stdout + proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and named in line, line


def test_the_memory_wall_plans_ep(monkeypatch):
    """EP's plan (an estimate: every parameter's state over every rank, the experts FSDP's over the groups since
    train_ep.py shards them there too): the same state per rank for every --ep, what differs being the experts a
    block gathers over the groups (none with one group); as FSDP's on 1 EP rank, less than DDP's whole copy, less
    with activation checkpointing; --experts counts in every strategy's plan; a run that does not fit is refused as
    EP's."""
    ep = {n: planned_peak_bytes(Config(strategy="ep", model="gpt", experts=8, ep=n), 4) for n in (1, 2, 4)}
    experts = 8 * 3 * 64 * 192  # baby's 8 experts of a block, each a SwiGLU of width 64, hidden 192
    # 4 ranks in 1, 2 and 4 groups: a block's 8 / ep experts gathered over them (fp32 weights and gradients)
    assert ep[4] == ep[2] - 8 * experts // 2 == ep[1] - 8 * experts
    assert ep[1] == planned_peak_bytes(Config(strategy="fsdp", model="gpt", experts=8), 4)  # EP 1 is FSDP per block
    ddp = planned_peak_bytes(Config(model="gpt", experts=8), 4)
    assert ep[1] < ddp and planned_peak_bytes(Config(model="gpt"), 4) < ddp  # (the experts: 8 MLPs a block)
    checkpointed = Config(strategy="ep", model="gpt", experts=8, activation_checkpointing=True)
    assert planned_peak_bytes(checkpointed, 4) < ep[4]
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 16 * 1024)
    check_memory(Config(strategy="ep", model="gpt", experts=8), nproc=4, world_size=4, on_cpu=True)  # baby fits
    with pytest.raises(ConfigError) as refused:
        check_memory(
            Config(strategy="ep", model="gpt", model_size="medium", experts=8), nproc=4, world_size=4, on_cpu=True
        )
    assert str(refused.value).startswith("--model-size medium: EP on 4 ranks needs 4 processes x ~")
