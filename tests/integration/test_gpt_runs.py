"""BabyGPT through the runners: run_all.sh's comparison of every strategy, the tokens/s (and, on a GPU, the MFU) each
run reports, what the runners refuse before torchrun (one error line, exit 2) and the memory wall for its sizes."""

import json
import re

import pytest

import runner.memory
from common.config import Config
from common.errors import ConfigError
from common.throughput import gpt_flops_per_token
from common.versions import NEEDS_TP, older_than
from runner.layout import pipeline_replicas, would_start
from runner.memory import check_memory, planned_peak_bytes
from tests.helpers import env_for_tests, markdown_rows, read_metrics, read_run, run_command
from tests.integration.early import Command

RUNS = ("ref", "ddp", "fsdp", "pippy", *(() if older_than(NEEDS_TP) else ("tp",)), "cp")  # (BabyGPT: CP too)
STEPS, SEQ_LEN, BATCH = 6, 32, 16
TINY = ["--model", "gpt", "--seq-len", str(SEQ_LEN), "--train-size", "512", "--test-size", "64"]
TINY += ["--batch-size", str(BATCH), "--dropout", "0", "--lr", "1e-4", "--max-steps", str(STEPS)]

# started with the session (tests/integration/early.py): the reference and the five strategies on 2 processes
STARTED = {"run_all": Command(["bash", "run_all.sh", *TINY], {"NPROC": "2", "OUT": "{out}"})}


@pytest.fixture(scope="module")
def run_all(early):
    return early.finished("gpt_runs/run_all")


def test_run_all_draws_every_strategy_of_babygpt(run_all):
    """compare.png.json, read back from the figure: each run's curve in each panel with every point it logged, the
    throughput in tokens/s, the title and the accuracy's axis a language model's; the runs agree step by step."""
    out, stdout = run_all
    figure = json.loads((out / "compare.png.json").read_text())
    assert figure["title"] == f"BabyGPT on copy, global batch {BATCH} sequences of {SEQ_LEN} tokens, seed 0"
    panels = {panel["title"]: panel for panel in figure["panels"]}
    for title in ("training loss per step", "learning rate per step", "global gradient norm before clipping"):
        assert [(c["name"], c["points"]) for c in panels[title]["curves"]] == [(name, STEPS) for name in RUNS], title
    accuracy = panels["test accuracy at each evaluation"]
    assert [(c["name"], c["points"]) for c in accuracy["curves"]] == [(name, 1) for name in RUNS]
    assert accuracy["ylabel"] == "next-token accuracy (%)"
    speed = panels["training throughput"]
    assert speed["ylabel"] == "tokens / s" and speed["bars"] == dict.fromkeys(RUNS, 1)
    assert [label.split(" ")[0] for label in figure["legend"]] == list(RUNS)
    rows = markdown_rows(stdout)
    assert sorted(rows) == sorted(RUNS)
    assert all(float(row["max |Δloss| vs ref"]) <= 1e-4 for row in rows.values()), rows


def test_every_strategy_reports_tokens_per_second_and_no_mfu_on_a_cpu(run_all):
    """Each train record's tokens/s is its sequences/s x --seq-len; run.json's, the launch's tokens over its steps'
    time, beside the FLOPs per token MFU would take (none on a CPU: no peak, no MFU); the table and the last line
    print it."""
    out, stdout = run_all
    rows = markdown_rows(stdout)
    done = re.findall(r"^done: .* \| (\d+) tokens/s \| ", stdout, flags=re.MULTILINE)
    assert len(done) == len(RUNS)
    for name in RUNS:
        train, _ = read_metrics(out / name)
        assert sorted(train) == list(range(1, STEPS + 1))
        for record in train.values():
            assert record["samples_per_s"] == pytest.approx(BATCH / record["step_time_s"], rel=1e-9)
            assert record["tokens_per_s"] == pytest.approx(record["samples_per_s"] * SEQ_LEN, rel=1e-12)
            assert record["mfu"] is None
        run = read_run(out / name)
        final = run["final"]
        tokens = BATCH * SEQ_LEN * STEPS / sum(record["step_time_s"] for record in train.values())
        assert final["tokens_per_s"] == pytest.approx(tokens, rel=1e-9) and final["mfu"] is None
        throughput = {k: v for k, v in run["throughput"].items() if k != "definition"}
        flops = gpt_flops_per_token("baby", vocab=128, seq_len=SEQ_LEN)
        assert throughput == {"seq_len": SEQ_LEN, "flops_per_token": flops, "device_name": None} | {
            "peak_flops_per_device": None
        }
        printed = f"{final['tokens_per_s']:.0f}"
        assert rows[name]["tokens/s"] == printed and printed in done


def test_run_all_cuts_a_pipeline_no_longer_than_the_model():
    """BabyGPT baby has 2 blocks to cut: on 4 processes run_all.sh runs its pipeline as 2 replicas of 2 stages."""
    gpt = Config(model="gpt", strategy="pippy")
    assert [pipeline_replicas(gpt, n) for n in (1, 2, 4, 8)] == [1, 1, 2, 4]
    assert pipeline_replicas(Config(model="gpt", strategy="pippy", model_size="small"), 8) == 2  # 6 blocks: 4 stages
    assert pipeline_replicas(Config(strategy="pippy"), 8) == 1  # BabyCNN baby: 8 stages
    assert would_start(Config(model="gpt", strategy="pippy", dp=2), 4)
    assert not would_start(gpt, 4)


@pytest.fixture
def files(tmp_path):
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "binary.dat").write_bytes(bytes(range(256)) * 20)
    return tmp_path


# (runner, NPROC, flags, what the line names); {dir}: the test's folder of files
REFUSED = [
    ("tp", 3, [], "--heads: 3 TP ranks do not split --heads (4: "),  # (an odd TP degree: the vocabulary neither)
    ("tp", 2, ["--kv-heads", "1"], "--kv-heads: 2 TP ranks do not split --kv-heads (1: "),
    ("tp", 3, ["--data-file", "{dir}/text.txt"], "use a TP degree of 1, 2, 4"),  # 256 bytes: the vocabulary too
    ("ddp", 2, ["--seq-len", "32768"], "--seq-len: 32768 tokens are beyond baby's context of 16384"),
    ("ddp", 2, ["--seq-len", "63"], "--seq-len: the built-in copy needs an even length"),
    ("ddp", 2, ["--model", "cnn", "--seq-len", "64"], "--seq-len: a flag of BabyGPT (--model gpt), not of the cnn"),
    ("fsdp", 2, ["--model", "vit", "--kv-heads", "2"], "--kv-heads: a flag of BabyGPT (--model gpt), not of the vit"),
    ("ddp", 2, ["--model", "cnn", "--data-file", "{dir}/text.txt"], "--data-file: a flag of BabyGPT"),
    ("ddp", 2, ["--data-file", "{dir}/missing.txt"], "missing.txt is not a file"),
    ("ddp", 2, ["--data-file", "{dir}/empty.txt"], "empty.txt is empty"),
    ("ddp", 2, ["--data-file", "{dir}/binary.dat"], "binary.dat is not text"),
    ("pippy", 2, ["--model-size", "gpt2-124m"], "which a pipeline puts in different stages; train it with DDP or FSDP"),
    ("tp", 2, ["--model-size", "gpt2-124m"], "which a TP would split twice; train it with DDP or FSDP"),
    # the memory wall: Llama 3 405B's training state alone is ~6.5 TB a DDP process, ~1.6 TB a TP rank of 4
    ("ddp", 4, ["--model-size", "llama3-405b"], "--model-size llama3-405b: DDP on 4 ranks needs 4 processes x"),
    ("tp", 4, ["--model-size", "llama3-405b"], "--model-size llama3-405b: TP on 4 ranks needs 4 processes x"),
]


@pytest.mark.parametrize("strategy, nproc, flags, named", REFUSED, ids=[f"{r[0]}-{r[3][:40]}" for r in REFUSED])
def test_bad_input_is_one_line_before_torchrun(files, strategy, nproc, flags, named):
    out = files / "out"
    flags = ["--model", "gpt", *(flag.replace("{dir}", str(files)) for flag in flags), "--out", str(out)]
    env = {**env_for_tests(), "NPROC": str(nproc)}
    proc = run_command(["bash", f"run_{strategy}.sh", *flags], env=env, check=False)
    assert proc.returncode == 2 and proc.stdout == "" and not out.exists(), proc.stderr
    [line] = proc.stderr.splitlines()
    assert line.startswith("error: ") and named in line


def test_the_memory_wall_holds_babygpt_to_what_fits(monkeypatch):
    """On a 16 GiB machine: BabyGPT medium's DDP on 4 processes does not fit (~23 GB), and the FSDP it names instead
    does (~15 GB); the planned peak grows with --seq-len and shrinks with TP's degree, sequence parallel and a
    pipeline's stages (each planned, where the wall crashed on them before)."""
    monkeypatch.setattr(runner.memory, "available_mib", lambda: 16 * 1024)
    medium = Config(model="gpt", model_size="medium")
    with pytest.raises(ConfigError) as refused:
        check_memory(medium, nproc=4, world_size=4, on_cpu=True)
    assert str(refused.value).startswith("--model-size medium: DDP on 4 ranks needs 4 processes x ~5.8 GB")
    assert str(refused.value).endswith("bash run_fsdp.sh --model gpt --model-size medium --shard-units blocks")
    blocks = Config(model="gpt", model_size="medium", strategy="fsdp", shard_units="blocks")
    check_memory(blocks, nproc=4, world_size=4, on_cpu=True)
    assert planned_peak_bytes(Config(model="gpt", model_size="medium", seq_len=256), 4) > planned_peak_bytes(medium, 4)
    tp = Config(model="gpt", model_size="small", strategy="tp")
    assert planned_peak_bytes(tp, 4) < planned_peak_bytes(tp, 2)
    assert planned_peak_bytes(Config(model="gpt", model_size="small", strategy="tp", sequence_parallel=True), 4) < (
        planned_peak_bytes(tp, 4)
    )
    pipeline = Config(model="gpt", model_size="small", strategy="pippy", dp=2)
    assert planned_peak_bytes(pipeline, 4) < planned_peak_bytes(Config(model="gpt", model_size="small"), 4)
    for cfg in (tp, pipeline):
        check_memory(cfg, nproc=4, world_size=4, on_cpu=True)
