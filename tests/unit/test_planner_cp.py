"""The planner's context parallelism (--model gpt): train_cp.py's wrap and step planned on the fake group, whose
sends the ring's batch_isend_irecv runs; the activations a rank holds shrink with cp where FSDP's do not; the ring's
sends counted are the formula's; the longest sequence each variant fits, verified by plans on both sides; bad input
in one line. BabyGPT baby and small at short sequences: seconds a plan."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from common.config import Config
from common.gpt_sizes import GPT_SIZES
from common.versions import NEEDS_PLANNER
from tests.helpers import needs_torch

pytestmark = needs_torch(NEEDS_PLANNER)

FSDP = "fsdp full, a unit per block"


def activations(size: str, variant: str, seq_len: int, world: int = 4) -> int:
    """What the worst rank's planned peak holds beyond its state: activations and temporaries."""
    from planner.plan import plan

    # 1 sequence per rank for FSDP; 1 per replica for CP, each of its ranks 1/cp of it (the planner's batches)
    per_rank = Config(model="gpt", model_size=size, batch_size=world, seq_len=seq_len)
    w = plan(variant, per_rank, world).worst
    return w.peak_bytes - w.param_bytes - w.grad_bytes - w.optim_bytes


@pytest.mark.parametrize("size, cps", [("baby", (2, 4)), pytest.param("small", (2,), marks=pytest.mark.heavy)])
def test_cp_divides_the_activations_fsdp_keeps_whole(size, cps):
    # one sequence of 1,024 tokens: FSDP's rank runs it all, a CP rank 1/cp of it (its two chunks), so what the
    # step keeps for backward (every block's inputs, attention's outputs and log-sum-exp, the logits) shrinks by cp;
    # measured: baby 1.02 x and 1.08 x 1/cp (what does not shrink: FSDP's unit gathered whole, a chunk in flight)
    fsdp = activations(size, FSDP, 1024)
    for cp in cps:
        mine = activations(size, f"cp {cp}", 1024)
        assert 0.95 <= mine * cp / fsdp <= 1.15, (size, cp, mine, fsdp)


def test_the_rings_counted_sends_are_the_formulas():
    # per attention layer per micro-batch each rank sends: forward (cp - 1) x kv, backward (cp - 1) x kv and cp x
    # the fp32 gradient accumulator dkv, kv = 2 x B x kv heads x seq_len / cp x head width elements; checkpointed,
    # backward runs forward's sends again first. baby: 2 blocks, 4 kv heads of 16; 2 sequences of 256 per replica
    from planner.plan import counted_steps, variant_config
    from planner.predict import ring_traffic

    shape = GPT_SIZES["baby"]
    for variant, precision, world in (("cp 2", "fp32", 4), ("cp 4, checkpointed", "bf16", 4)):
        cp = int(variant.split(",")[0].split()[1])
        base = Config(model="gpt", model_size="baby", batch_size=2 * world, seq_len=256, precision=precision)
        cfg = variant_config(variant, base, world)
        assert (cfg.strategy, cfg.dp, cfg.chunk_size(world)) == ("cp", world // cp, 2)
        kv = 2 * 2 * shape.kv_heads * (256 // cp) * (shape.width // shape.heads)
        item = 2 if precision == "bf16" else 4  # (FSDP's param_dtype: the layers' outputs, k and v among them)
        again = 2 if cfg.activation_checkpointing else 1
        expected = {
            "forward": {"kv_sends": 2 * (cp - 1), "kv_bytes": kv * item, "dkv_sends": 0, "dkv_bytes": kv * 4},
            "backward": {
                "kv_sends": 2 * (cp - 1) * again,
                "kv_bytes": kv * item,
                "dkv_sends": 2 * cp,
                "dkv_bytes": kv * 4,
            },
        }
        assert ring_traffic(cfg, world) == expected, variant
        count = counted_steps(cfg, world)[0]
        sends = Counter((c.phase, c.bytes, c.group_size) for c in count.collectives if c.kind == "send")
        recvs = Counter((c.phase, c.bytes) for c in count.collectives if c.kind == "recv")
        wanted = Counter()
        for phase, s in expected.items():
            wanted[phase, s["kv_bytes"], 2] += s["kv_sends"]
            wanted[phase, s["dkv_bytes"], 2] += s["dkv_sends"]
        assert sends == +wanted, variant
        assert recvs == Counter({(p, b): n for (p, b, _), n in sends.items()}), variant  # (one in for each out)


def test_the_ring_is_timed_beside_attention_on_a_gpu():
    # h100-sxm: the ring's sends are in the step's communication; of them the kv sends hide behind cp - 1 of the
    # cp blocks of attention, the gradient accumulator's timed exposed (an upper bound)
    from planner.plan import counted_steps, variant_config
    from planner.predict import ring_traffic
    from planner.timing import load_profile, rank_time, ring_time

    base = Config(model="gpt", model_size="baby", batch_size=4, seq_len=1024)
    cfg = variant_config("cp 4", base, 4)
    count = counted_steps(cfg, 4)[0]
    ring = {**ring_traffic(cfg, 4), "cp": 4}
    gpu = load_profile("h100-sxm")
    with_ring, without = (rank_time(count, gpu, procs_per_node=4, ring=r) for r in (ring, None))
    timed = ring_time(ring, gpu, {"forward": 1.0, "backward": 1.0, "optimizer": 0.0})  # (a second of attention)
    for phase in ("forward", "backward"):
        seconds, hidden = timed[phase]
        kv = ring[phase]["kv_sends"] * seconds / (ring[phase]["kv_sends"] + ring[phase]["dkv_sends"])
        assert seconds > 0 and hidden == pytest.approx(kv), phase  # (all of kv hides behind a second)
        assert with_ring.communication[phase] >= seconds > 0
    # (without `ring` the counted sends are all exposed: the ring's overlap can only shorten the step)
    assert sum(with_ring.compute.values()) < with_ring.step_s < without.step_s
    nothing = ring_time(ring, gpu, {"forward": 0.0, "backward": 0.0, "optimizer": 0.0})  # (no attention to hide in)
    assert all(hidden == 0 for _, hidden in nothing.values())


def test_the_longest_sequence_is_planned_on_both_sides():
    # 24 MB a rank, 1 sequence per rank (CP: per replica) in multiples of 256 tokens: the length found fits, the
    # next multiple does not, each planned again here; cp 4 fits more than 3 x FSDP's (the search starts at each
    # plan's own length: near the answer, a few plans)
    from planner.plan import plan
    from planner.report import longest_sequence

    memory, found = 24_000_000, {}
    for variant, start in ((FSDP, 1024), ("cp 4", 4096)):
        base = Config(model="gpt", model_size="baby", batch_size=4, seq_len=start)
        p = plan(variant, base, 4)
        got = longest_sequence(p, memory, per_rank_batch=1, granule=256)
        assert got.step == 256 and got.over == got.fits + 256, (variant, got)
        for length, fits in ((got.fits, True), (got.over, False)):
            worst = plan(variant, Config(**{**base.__dict__, "seq_len": length}), 4).worst
            assert (worst.peak_bytes <= memory) == fits, (variant, length, worst.peak_bytes)
        found[variant] = got.fits
    assert found["cp 4"] >= 3 * found[FSDP], found


def test_the_planner_command_answers_the_longest_sequence(tmp_path, capsys):
    from planner.__main__ import main

    out = tmp_path / "plan.json"
    flags = ["--model", "gpt", "--model-size", "baby", "--world-sizes", "4", "--per-rank-batch", "1"]
    flags += ["--variants", "cp 4", "--seq-len", "4096", "--device-memory", "24MB", "--longest-sequence", "2048"]
    assert main([*flags, "--jobs", "1", "--json", str(out)]) == 0
    said = capsys.readouterr().out
    assert "| cp 4 | 4 |" in said and "The longest sequence that fits 24.0 MB" in said
    (plan,) = json.loads(out.read_text())
    longest = plan["longest_sequence"]
    assert plan["flags"]["strategy"] == "cp" and plan["flags"]["dp"] == 1
    assert longest["step"] == 2048 and longest["over"] == longest["fits"] + 2048
    assert f"- cp 4 on 4: {longest['fits']:,} tokens" in said


@pytest.mark.parametrize(
    "flags, said",
    [
        (
            ["--seq-len", "100", "--variants", "cp 4"],
            "error: --world-sizes: cp 4 cannot run on 4 ranks: --seq-len: 100",
        ),
        (["--variants", "cp 8"], "error: --world-sizes: cp 8 cannot run on 4 ranks: 8 CP ranks do not divide"),
        (["--variants", "cp 3"], "error: --variants: no variant 'cp 3' for --model gpt"),
        (["--longest-sequence"], "error: --longest-sequence: a question of --model gpt against a --device-memory"),
    ],
)
def test_the_planner_refuses_a_cp_it_cannot_plan_in_one_line(flags, said, capsys):
    from planner.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(["--model", "gpt", "--model-size", "baby", "--world-sizes", "4", *flags])
    out, err = capsys.readouterr()
    assert ended.value.code == 2 and out == "" and err.count("\n") == 1 and err.startswith(said), err
