"""The time model's arithmetic (planner/timing.py) on hand-made counts and profiles, the published profiles' shape,
and the planner's one-line refusals of a profile it cannot use."""

import json
from dataclasses import replace

import pytest

from common.errors import ConfigError
from common.versions import NEEDS_PLANNER
from planner.count import DTENSOR_CALL, Collective, Op, StepCount
from planner.timing import (
    PROFILES,
    Compute,
    Profile,
    load_profile,
    operator_key,
    pipeline_time,
    predict,
    rank_time,
    simulate_sharing,
)
from tests.helpers import needs_torch


def gpu(overlap: bool = True) -> Profile:
    compute = {1: Compute({"matmul": 1e12}, 1e12, 1e-6, launch_overlaps=True)}
    links = {
        "node": {"busbw_bytes_per_s": 1e11, "latency_s": 0.0},
        "network": {"busbw_bytes_per_s": 1e10, "latency_s": 0.0},
    }
    return Profile("test gpu", "gpu", compute, {"fp32": 1e12}, devices_per_node=8, links=links, overlap=overlap)


def mm(flops: int, phase: str = "backward", *, calls: int = 1, action: str = "", nbytes: int = 0, dtype="fp32") -> Op:
    return Op("aten.mm", phase, flops, nbytes, calls, action, dtype=dtype)


def step(*, matmul_flops: int, collectives: list[Collective]) -> StepCount:
    count = StepCount(collectives=collectives)
    count.ops[("aten.mm", (), "backward", "")] = mm(matmul_flops)
    return count


def test_an_operator_takes_its_work_and_its_overhead():
    cpu = Compute({"matmul": 1e9, "conv": 5e8}, 1e9, 1e-5)
    assert cpu.op_time(mm(2_000_000)) == pytest.approx(2e-3 + 1e-5)  # added on a CPU
    assert cpu.op_time(Op("aten.convolution", "forward", 1_000_000, 0)) == pytest.approx(2e-3 + 1e-5)
    assert cpu.op_time(Op("aten.relu", "forward", 0, 4_000_000)) == pytest.approx(4e-3 + 1e-5)  # bytes / bandwidth
    assert cpu.op_time(Op("aten.t", "forward", 0, 4_000_000)) == 0  # a view moves nothing, costs no call
    assert cpu.op_time(Op("aten.empty", "forward", 0, 4_000_000)) == pytest.approx(1e-5)  # an allocation: its call
    # the optimizer's and the gradient norm's calls: plain no-grad Python, no module or autograd node, on a CPU
    # their work alone (what timing them alone took); on a GPU the host still launches each
    assert cpu.op_time(Op("aten.add_", "optimizer", 0, 4_000_000)) == pytest.approx(4e-3)
    timed = Op("aten.relu", "forward", 0, 4_000_000, signature="aten.relu.default[]", shapes=((1000,),))
    table = Compute({}, 1e9, 1e-5, operators={operator_key(timed): 7e-3})
    assert table.op_time(timed) == pytest.approx(7e-3 + 1e-5)  # the profile timed this very call
    device = Compute({"matmul:bf16": 1e12, "matmul": 1e11}, 1e12, 1e-5, launch_overlaps=True)
    assert device.op_time(mm(10**6, dtype="bf16")) == pytest.approx(1e-5)  # a tiny kernel: the launch's time
    assert device.op_time(mm(10**9, dtype="bf16")) == pytest.approx(1e-3)  # a large one: its own
    assert device.op_time(mm(10**9)) == pytest.approx(1e-2)  # no fp32 rate of its own: the class's
    assert device.op_time(Op("aten.add_", "optimizer", 0, 4)) == pytest.approx(1e-5)


def test_overlapped_communication_hides_behind_compute_and_tp_s_does_not():
    # 1 ms of backward compute and 8 bucket all-reduces of 12.5 MB over 8 GPUs of a node: 8 x 12.5 MB x 2 x 7/8 /
    # 100 GB/s = 1.75 ms of communication; overlapped in 8 chunks, the step takes max(1 + 1.75/8, 1.75 + 1/8) ms
    buckets = [Collective("all_reduce", 8, 12_500_000, "backward") for _ in range(8)]
    ddp = rank_time(step(matmul_flops=10**9, collectives=buckets), gpu(), procs_per_node=8)
    assert ddp.communication["backward"] == pytest.approx(1.75e-3)
    assert ddp.step_s == pytest.approx(1.75e-3 + 1e-3 / 8)
    tp_like = [Collective("all_reduce", 8, 12_500_000, "backward", functional=True) for _ in range(8)]
    tp = rank_time(step(matmul_flops=10**9, collectives=tp_like), gpu(), procs_per_node=8)  # the next op waits
    assert tp.step_s == pytest.approx(1e-3 + 1.75e-3) and tp.exposed["backward"] == pytest.approx(1.75e-3)
    no_overlap = rank_time(step(matmul_flops=10**9, collectives=buckets), gpu(overlap=False), procs_per_node=8)
    assert no_overlap.step_s == pytest.approx(tp.step_s)
    logged = [Collective("all_reduce", 8, 12_500_000, "optimizer", logged=True)]  # after backward: nothing to hide in
    assert rank_time(step(matmul_flops=10**9, collectives=logged), gpu(), procs_per_node=8).step_s == pytest.approx(
        1e-3 + 12_500_000 * 2 * 7 / 8 / 1e11
    )


def test_a_group_across_nodes_runs_at_the_network_s_bandwidth():
    within = Collective("all_gather", 8, 10**9, "forward", "", (0, 1))  # ranks 0-7: one node
    across = Collective("all_gather", 8, 10**9, "forward", "", (0, 8))  # ranks 0, 8, ..., 56: eight nodes
    assert gpu().collective_time(within) == pytest.approx(10**9 * 7 / 8 / 1e11)
    assert gpu().collective_time(across) == pytest.approx(10**9 * 7 / 8 / 1e10)
    assert gpu().collective_time(Collective("recv", 2, 10**9, "forward")) == 0  # counted at its sender


def cpu_profile(cores: int = 2) -> Profile:
    """A CPU whose one thread does 1 GFLOP/s (2 threads 2), and whose collectives bench.collectives measured at
    2 ranks: an all-reduce 1 ms a MB."""
    threads = {1: Compute({"matmul": 1e9}, 1e9, 0.0), 2: Compute({"matmul": 2e9}, 2e9, 0.0)}
    rows = [{"op": "all_reduce", "bytes": b, "time_s": b / 1e9} for b in (10**3, 10**6)]
    return Profile("test cpu", "cpu", threads, {"fp32": 2e9}, cores=cores, collectives={2: rows})


def test_processes_that_share_the_cores_share_their_time():
    count = step(matmul_flops=10**9, collectives=[])
    assert rank_time(count, cpu_profile(), procs_per_node=1).step_s == pytest.approx(0.5)
    assert rank_time(count, cpu_profile(), procs_per_node=2).step_s == pytest.approx(1.0)
    four = rank_time(count, cpu_profile(), procs_per_node=4)
    assert four.step_s == pytest.approx(2.0) and four.sharing_s == pytest.approx(1.0)


def test_a_cpu_collective_takes_what_was_measured_and_beyond_it_the_largest_size_s_bandwidth():
    cpu = cpu_profile()
    assert cpu.collective_time(Collective("all_reduce", 2, 10**6, "backward")) == pytest.approx(1e-3)
    assert cpu.collective_time(Collective("all_reduce", 2, 10**8, "backward")) == pytest.approx(0.1)  # 100 x 1 MB
    assert cpu.collective_time(Collective("all_reduce", 4, 10**6, "backward")) == pytest.approx(1e-3 * 1.5)  # 2*3/4
    # one size out of line with its neighbours is read at the median of the three; the sizes around it as measured
    rows = [
        {"op": "all_reduce", "bytes": b, "time_s": t} for b, t in ((1e3, 2e-3), (1e4, 1e-3), (1e5, 3e-3), (1e6, 4e-3))
    ]
    noisy = Profile("test cpu", "cpu", cpu.compute, {"fp32": 2e9}, cores=2, collectives={2: rows})
    assert [noisy.collective_time(Collective("all_reduce", 2, int(b), "backward")) for b in (1e3, 1e4, 1e5, 1e6)] == (
        pytest.approx([2e-3, 2e-3, 3e-3, 4e-3])
    )
    with pytest.raises(ConfigError, match="no all_gather measured"):
        cpu.collective_time(Collective("all_gather", 2, 10**6, "forward"))


def test_a_cpu_collective_costs_a_step_what_was_measured_after_compute_beyond_its_row(tmp_path):
    from dataclasses import asdict

    cpu = cpu_profile()
    # bench.collectives --after-compute, per group size: (compute before it, what the all-reduce cost beyond its row)
    cpu.after_compute = {2: [(1e-3, 1e-3), (4e-3, 2e-3)], 4: [(1e-3, 5e-3), (4e-3, 6e-3)]}
    reduce = lambda n: Collective("all_reduce", n, 10**6, "backward")  # noqa: E731  (the row: 1 ms on 2 ranks)
    assert cpu.collective_time(reduce(2)) == pytest.approx(1e-3)  # back to back: the row's time alone
    assert cpu.collective_time(reduce(2), 0.5e-3) == pytest.approx(1e-3 + 0.5e-3)  # from none after no compute
    assert cpu.collective_time(reduce(2), 2.5e-3) == pytest.approx(1e-3 + 1.5e-3)  # between two points
    assert cpu.collective_time(reduce(2), 1.0) == pytest.approx(1e-3 + 2e-3)  # beyond the last: its value
    assert cpu.collective_time(reduce(8), 4e-3) == pytest.approx(
        1e-3 * (2 * 7 / 8) + 6e-3  # the bus bandwidth at 2 ranks', the cost after compute at 4's: the nearest
    )
    assert cpu.collective_time(Collective("recv", 2, 10**6, "forward"), 1.0) == 0  # counted at its sender
    cpu.after_compute = {2: [(1e-3, -1e-4), (4e-3, -2e-4)]}  # below zero (the noise): nothing, not less than the row
    assert cpu.collective_time(reduce(2), 2e-3) == pytest.approx(1e-3)
    # what bench.machine writes, read back; a profile of one figure (measured before the curve): that figure whatever
    # the compute; one measured before either: the row's time alone
    data = {k: v for k, v in asdict(cpu_profile()).items() if k not in ("compute", "after_compute")}
    data["compute"] = {"1": {"flops": {"matmul": 1e9}, "memory_bytes_per_s": 1e9, "op_overhead_s": 0.0}}
    for written, compute_s, expected in (
        ({"2": [[1e-3, 1e-3], [4e-3, 2e-3]]}, 2.5e-3, 2.5e-3),
        ({"2": 2e-3}, 0.0, 3e-3),
        ({"2": 2e-3}, 1.0, 3e-3),
        (None, 1e-3, 1e-3),
    ):
        path = tmp_path / "profile.json"
        path.write_text(json.dumps({**data, **({"collective_after_compute_s": written} if written else {})}))
        loaded = load_profile(str(path))
        assert loaded.collective_time(reduce(2), compute_s) == pytest.approx(expected), written


def test_a_collective_costs_after_what_its_rank_computed_since_the_one_before():
    """Collective.before: the operators (and DTensor's calls) its rank ran since its previous collective, their time
    on this profile, sharing the cores, is the compute the cost after it is read at."""
    cpu = cpu_profile()
    cpu.after_compute = {2: [(1e-3, 1e-3), (1.0, 1.0)]}  # the cost after compute: as long as that compute, to 1 s
    cpu.compute[1] = replace(cpu.compute[1], dtensor_overhead_s=1e-4)
    count = StepCount()
    a, b = ("a",), ("b",)
    count.ops[a], count.ops[b] = mm(10**6, calls=1), mm(3 * 10**6, calls=2)  # 1 ms and 3 ms a call at 1 thread
    first = Collective("all_reduce", 2, 10**3, "backward", before=((a, 1),))
    second = Collective("all_reduce", 2, 10**3, "backward", before=((b, 2), (DTENSOR_CALL, 5)))
    count.collectives = [first, second]
    row = 10**3 / 1e9  # the table's time of 1 KB
    two = rank_time(count, cpu, procs_per_node=2)  # a thread each on 2 cores
    assert two.communication["backward"] == pytest.approx(2 * row + 1e-3 + (6e-3 + 5e-4))
    four = rank_time(count, replace(cpu, cores=1), procs_per_node=2)  # 2 ranks on 1 core: the compute takes twice
    assert four.communication["backward"] == pytest.approx(2 * row + 2 * (1e-3 + 6.5e-3))
    assert first == Collective("all_reduce", 2, 10**3, "backward")  # (what it follows is not what it is)


def two_stages(sent_bytes: int = 0) -> list[StepCount]:
    """Two stages of 1 ms per forward and 2 ms per backward (1 GFLOP/s), 2 micro-batches in GPipe's order; with
    `sent_bytes`, stage 0 sends each forward's activation and stage 1 each backward's gradient."""
    counts = []
    for stage in (0, 1):
        count = StepCount()
        count.actions = [(stage, "F", 0), (stage, "F", 1), (stage, "B", 0), (stage, "B", 1)]
        count.ops[("f", stage)] = mm(10**6, "forward", calls=2, action=f"{stage}F")
        count.ops[("b", stage)] = mm(2 * 10**6, "backward", calls=2, action=f"{stage}B")
        if sent_bytes:
            send = Collective("send", 2, sent_bytes, *(("forward", "0F") if stage == 0 else ("backward", "1B")))
            count.collectives = [send, send]  # (one a micro-batch)
        counts.append(count)
    return counts


def test_the_pipeline_s_step_is_its_schedule_simulated():
    # stage 1 runs 1-3 ms forward and 3-7 ms backward, stage 0 waits for each of its gradients: 5-7 and 7-9 ms.
    # 9 ms, idle 1 - 12 / 18
    cpu = Profile("test cpu", "cpu", {1: Compute({"matmul": 1e9}, 1e9, 0.0)}, {"fp32": 1e9}, cores=2)
    seconds, bubble, ranks = pipeline_time(two_stages(), cpu, procs_per_node=2, ranks=[0, 1])
    assert seconds == pytest.approx(9e-3) and bubble == pytest.approx(1 - 12 / 18)
    assert [r.compute["forward"] + r.compute["backward"] for r in ranks] == pytest.approx([6e-3, 6e-3])
    assert [r.bubble_s for r in ranks] == pytest.approx([3e-3, 3e-3])


def test_what_a_stage_sends_delays_the_stage_that_receives_it_not_the_sender():
    # each activation and gradient 1 MB sent at 1 GB/s (1 ms): stage 0 forwards at 0-1 and 1-2 ms, not waiting for
    # its sends; stage 1 receives at 2 and 3, forwards 2-3 and 3-4, backward 4-6 and 6-8; stage 0 receives the
    # gradients at 7 and 9: 7-9 and 9-11 ms. Sent from the sender's time, the step would take 13 ms
    rows = [{"op": "send_recv", "bytes": b, "time_s": b / 1e9} for b in (10**3, 10**6)]
    compute = {1: Compute({"matmul": 1e9}, 1e9, 0.0)}
    cpu = Profile("test cpu", "cpu", compute, {"fp32": 1e9}, cores=2, collectives={2: rows})
    seconds, bubble, ranks = pipeline_time(two_stages(10**6), cpu, procs_per_node=2, ranks=[0, 1])
    assert seconds == pytest.approx(11e-3) and bubble == pytest.approx(1 - 12 / 22)
    assert [r.communication["forward"] for r in ranks] == pytest.approx([2e-3, 2e-3])  # on the wire
    assert [r.exposed["forward"] for r in ranks] == [0, 0]  # its wait is the receiver's: bubble
    assert [r.bubble_s for r in ranks] == pytest.approx([5e-3, 5e-3])
    # one core for both: alone until 7 ms, then stage 0's first backward and stage 1's second share it (7-9 ms, half
    # speed each): stage 1 ends at 9, its gradient arrives at 10, where stage 0 ends its first: 10-12 ms
    one_core = replace(cpu, cores=1)
    assert pipeline_time(two_stages(10**6), one_core, procs_per_node=2, ranks=[0, 1])[0] == pytest.approx(12e-3)


def test_a_step_predicted_end_to_end_from_planned_ranks():
    from common.config import Config

    # DDP on 2 processes of the test CPU: each rank 1 GFLOP at 1 GFLOP/s and a 1 MB all-reduce: 1.001 s a step
    counts = {0: step(matmul_flops=10**9, collectives=[Collective("all_reduce", 2, 10**6, "backward")])}
    found = predict(Config(strategy="ddp", batch_size=64), 2, counts, cpu_profile())
    assert found.step_s == pytest.approx(1.001) and found.samples_per_s == pytest.approx(64 / 1.001)
    assert found.exposed_s == pytest.approx(1e-3) and found.mfu > 0


@pytest.mark.parametrize("name", sorted(p.stem for p in PROFILES.glob("*.json")))
def test_every_published_profile_loads_and_cites_a_source_for_its_numbers(name):
    profile = load_profile(name)
    assert profile.kind == "gpu" and profile.peak("bf16") > profile.peak("fp32") > 0
    assert set(profile.links) == {"node", "network"}
    assert {"peak_flops", "memory_bytes_per_s", "links.node", "links.network"} <= set(profile.sources)
    assert all(value > 0 for value in profile.compute[1].flops.values())


def test_a_profile_that_is_not_one_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"--profile: no profile 'tpu-v9'; use one of a100-sxm, h100-sxm"):
        load_profile("tpu-v9")
    broken = tmp_path / "mine.json"
    broken.write_text("{ not json")
    with pytest.raises(ConfigError, match=r"mine.json is not a machine profile \(not JSON"):
        load_profile(str(broken))
    broken.write_text(json.dumps({"name": "x", "kind": "gpu"}))
    with pytest.raises(ConfigError, match=r"is not a machine profile \(KeyError: 'links'\)"):
        load_profile(str(broken))
    broken.write_text(json.dumps({"name": "x", "kind": "tpu"}))
    with pytest.raises(ConfigError, match=r"is not a machine profile \(ValueError: kind 'tpu': cpu or gpu\)"):
        load_profile(str(broken))


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--profile", "tpu-v9"], "error: --profile: no profile 'tpu-v9'"),
        (
            ["--variants", "ddp; fsdp x tp", "--world-sizes", "3"],
            "error: --world-sizes: fsdp x tp cannot run on 3 ranks",
        ),
        (["--variants", "zero-3"], "error: --variants: no variant 'zero-3' for --model cnn"),
    ],
)
@needs_torch(NEEDS_PLANNER)
def test_the_planner_refuses_what_it_cannot_plan_in_one_line(flags, said, capsys):
    from planner.__main__ import main

    with pytest.raises(SystemExit) as ended:
        main(["--model-size", "baby", *flags])
    out, err = capsys.readouterr()
    errors = [line for line in err.splitlines() if not line.startswith("planning ")]
    assert ended.value.code == 2 and out == "" and len(errors) == 1 and errors[0].startswith(said), err


@needs_torch(NEEDS_PLANNER)
def test_bench_scale_plans_each_run_and_predicts_it_with_a_profile_without_launching():
    """python -m bench.scale's plan of a run: the rank that needs the most, the bytes it sends (planner/predict.py),
    and with a profile its step; a run the scripts would not start is skipped, not launched."""
    from bench.scale import plan_one
    from common.model_sizes import parameter_count

    h100 = load_profile("h100-sxm")
    row = plan_one("cnn", "baby", "ddp", 2, steps=6, profile=h100)
    assert row["planned_peak_bytes"] > row["planned_state_bytes"] > 16 * parameter_count("baby")  # + AdamW's
    assert row["sent_per_step_bytes"] == pytest.approx(4 * parameter_count("baby"), rel=0.01)  # ring: 2(n-1)/n = 1
    assert row["predicted"]["samples_per_s"] > 0 and row["rounds"] == [] and "ranks" not in row["predicted"]
    assert row["command"].startswith("NPROC=2 bash run_ddp.sh --model cnn --model-size baby --max-steps 6")
    assert "predicted" not in plan_one("cnn", "baby", "ddp", 1, steps=6, profile=None)
    assert plan_one("cnn", "baby", "tp-sp", 2, steps=6, profile=None)["skipped"] == "no tokens to split"
    assert "skipped" in plan_one("vit", "baby", "fsdp-x-tp", 2, steps=6, profile=None)


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--strategies", "ddp,zero3"], "error: --models or --strategies: zero3; a model is model:size"),
        (["--models", "cnn"], "error: --models or --strategies: ['cnn']; a model is model:size"),
        (["--steps", "4"], "error: --steps 4 --rounds 1: at least 6 steps and 1 round"),
        (["--procs", "2,x"], "error: --procs: '2,x'; give positive whole numbers"),
        (["--profile", "tpu-v9"], "error: --profile: no profile 'tpu-v9'"),
        (["--rounds", "many"], "error: argument --rounds: invalid int value: 'many' (see --help)"),
    ],
)
def test_bench_scale_refuses_bad_flags_in_one_line(flags, said, capsys, tmp_path):
    from bench.scale import main

    with pytest.raises(SystemExit) as ended:
        main([*flags, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert ended.value.code == 2 and err.count("\n") == 1 and err.startswith(said), err
    assert not (tmp_path / "scale.json").exists()


def test_ranks_that_share_the_cores_share_them_only_while_busy():
    # two ranks, one core: rank 0's forward (1 s) alone runs at full speed; then rank 0's second forward and rank 1's
    # first run together at half speed each (2 s), then rank 1's second alone (1 s): 4 s, each busy 3 s
    orders = [[(0, "F", 0), (0, "F", 1)], [(1, "F", 0), (1, "F", 1)]]
    makespan, busy = simulate_sharing(orders, lambda stage, kind: 1.0, cores=1, threads=1)
    assert makespan == pytest.approx(4.0) and busy == pytest.approx([3.0, 3.0])
    assert simulate_sharing(orders, lambda stage, kind: 1.0, cores=2, threads=1)[0] == pytest.approx(3.0)


def test_the_fit_recovers_the_rates_it_was_made_from():
    from bench.fits import fit

    # operators timed as 20 us + FLOPs / 50 GFLOP/s (matmuls) or + bytes / 10 GB/s (the rest)
    rows = [("matmul", f, 0, 20e-6 + f / 50e9, 1) for f in (10**6, 10**7, 10**8)]
    rows += [("memory", 0, b, 20e-6 + b / 10e9, 3) for b in (10**4, 10**6, 10**8)]
    found = fit(rows)
    assert found["flops"]["matmul"] == pytest.approx(50e9, rel=1e-6)
    assert found["memory_bytes_per_s"] == pytest.approx(10e9, rel=1e-6)
    assert found["op_overhead_s"] == pytest.approx(20e-6, rel=1e-6)


def test_dtensor_calls_and_fsdp_units_cost_their_python_besides_their_operators():
    # 1 ms of matmul; 10 DTensor calls in forward and 20 in backward at 0.1 ms; 4 FSDP units at 1 ms a step; 2 ms
    # once a step (the optimizer's Python)
    cpu = Profile(
        "test cpu",
        "cpu",
        {2: Compute({"matmul": 1e9}, 1e9, 0.0, step_overhead_s=2e-3, dtensor_overhead_s=1e-4, unit_overhead_s=1e-3)},
        {"fp32": 2e9},
        cores=2,
    )
    count = step(matmul_flops=10**6, collectives=[])
    count.dtensor_calls.update({("forward", ""): 10, ("backward", ""): 20})
    count.fsdp_units = 4
    found = rank_time(count, cpu, procs_per_node=1)
    assert found.step_s == pytest.approx(1e-3 + 3e-3 + 4e-3 + 2e-3) and found.overhead_s == pytest.approx(9e-3)
    assert found.compute["forward"] == pytest.approx(1e-3 + 2e-3)  # half a unit's hooks run before backward
    # a pipeline's DTensor calls (PP x TP) belong to the stage action that made them
    stage = StepCount(actions=[(0, "F", 0)])
    stage.ops[("f",)] = mm(10**6, "forward", action="0F")
    stage.dtensor_calls["forward", "0F"] = 10
    seconds, _, _ = pipeline_time([stage], cpu, procs_per_node=1, ranks=[0])
    assert seconds == pytest.approx(1e-3 + 1e-3 + 2e-3)


def test_the_profile_splits_what_steps_cost_beyond_their_operators_into_each_step_s_each_call_s_and_dtensor_s():
    from bench.fits import split_overhead, wrapped_overheads

    # plain eager steps of 40, 250 and 400 kernel calls, 4 ms once and 30 us a call beyond their operators
    eager = split_overhead([(4e-3 + k * 30e-6, k) for k in (40, 250, 400)])
    assert eager["step_overhead_s"] == pytest.approx(4e-3) and eager["op_overhead_s"] == pytest.approx(30e-6)
    # each wrapped step is set against its own model's eager step, whatever that one costs beyond the fit (44 ms
    # here, where the fit's plain step of 100 calls costs 7 ms): a TP step of 10 DTensor calls and 2 more kernel
    # calls, 1 ms more than its eager step (0.1 ms a call); an FSDP step of 8 DTensor calls (0.8 ms) and 2 units
    # (1.05 ms each), 2.9 ms more than its eager step
    tp, fsdp = StepCount(), StepCount(fsdp_units=2)
    tp.dtensor_calls["forward", ""], fsdp.dtensor_calls["optimizer", ""] = 10, 8
    own = (44e-3, 100)
    steps = [(44e-3 + 2 * 30e-6 + 1e-3, 102, tp, own), (44e-3 + 2.9e-3, 100, fsdp, own)]
    found = wrapped_overheads(steps, eager["op_overhead_s"])
    assert found["dtensor_overhead_s"] == pytest.approx(1e-4)
    assert found["unit_overhead_s"] == pytest.approx(1.05e-3)
    # weighed by calls: a second TP step of 990 calls at 20 us each brings the cost a call to 20.8 us, not the
    # mean of the two (55 us)
    vit = StepCount()
    vit.dtensor_calls["forward", ""] = 990
    steps.append((10e-3 + 990 * 20e-6, 600, vit, (10e-3, 600)))
    assert wrapped_overheads(steps, eager["op_overhead_s"])["dtensor_overhead_s"] == pytest.approx(20.8e-6)


@needs_torch(NEEDS_PLANNER)
def test_the_profile_s_measuring_steps_keep_their_gradients_off_subnormal_floats():
    import torch

    from bench.machine import _counted_step
    from common.config import Config
    from planner.measure import _model

    # trained at the scripts' lr over and over on the same 2 samples, BabyCNN's loss falls toward 0 and 13,290 of
    # its 1.27 M gradients were subnormal within 40 steps: ~75x slower a convolution on an Intel CPU, read by the
    # profile as Python. Its steps run at lr 0: the same work, the weights where they start.
    cfg = Config()
    model = _model(cfg)
    step, _ = _counted_step(cfg, model)
    for _ in range(40):
        step()
    tiny = torch.finfo(torch.float32).tiny
    assert sum(int(((p.grad.abs() < tiny) & (p.grad != 0)).sum()) for p in model.parameters()) == 0


def test_the_profile_times_each_operator_on_inputs_out_of_the_caches():
    import torch

    from bench.machine import COLD_BYTES, cold_inputs, time_op
    from planner.count import StepCounter

    a = torch.ones(256, 256)  # 256 KiB; mm reads two: 512 KiB a call
    with StepCounter() as counter:
        torch.mm(a, a)
    (op,) = counter.count.ops.values()
    copies = cold_inputs(op)  # timed in turn: a call's inputs were last read COLD_BYTES of other inputs ago
    assert len(copies) == COLD_BYTES // (512 << 10)
    pointers = {tensor.data_ptr() for args, _ in copies for tensor in args}
    assert len(pointers) == 2 * len(copies)  # every input its own memory, the two of a call apart too
    assert not torch.equal(copies[0][0][0], copies[1][0][0])  # random floats in each
    assert time_op(op) > 0


def test_a_step_s_large_new_storages_are_counted_and_take_their_first_touch_at_the_profile_s_rate():
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from planner.count import MMAP_THRESHOLD, StepCounter

    side = 4096  # a 4096 x 4096 float32 matrix: 64 MiB, over the threshold; a row of it far under
    with FakeTensorMode():
        a = torch.empty(side, side)
        with StepCounter() as counter:
            big = torch.mm(a, a)  # a new storage: counted
            torch.empty(side * side)  # an allocation: counted, though it writes nothing yet
            big.t()  # a view, an in-place update and a small output make no large storage
            big.add_(1.0)
            big[0].sum()
            torch.split_with_sizes(big, [side // 2, side // 2])  # views, not copies
    fresh = {op.name: op.fresh_bytes for op in counter.count.ops.values()}
    assert 4 * side * side >= MMAP_THRESHOLD
    assert fresh["aten.mm"] == fresh["aten.empty"] == 4 * side * side
    assert {"aten.t", "aten.add_", "aten.sum", "aten.split_with_sizes"} <= set(fresh)  # (seen, and none made one)
    assert {name for name, n in fresh.items() if n} == {"aten.mm", "aten.empty"}
    # on a CPU profile that measured the first touch, its bytes at that rate besides the operator's own time
    op = Op("aten.empty", "forward", 0, 0, 1, fresh_bytes=2 << 30)
    assert Compute({}, 1e9, 0.0, fresh_bytes_per_s=1e9).op_time(op) == pytest.approx(2.147483648)
    assert Compute({}, 1e9, 0.0, launch_overlaps=True).op_time(op) == 0  # a GPU's caching allocator keeps its blocks


def test_the_runs_map_large_buffers_afresh_and_the_measuring_process_none():
    """What the first touch is counted for (glibc): with the runs' allocator setting (keep_freed_memory), a buffer of
    MMAP_THRESHOLD comes mapped on its own and one a MiB smaller from the heap; after keep_every_page, as
    bench.machine times its operators, neither does."""
    import ctypes
    import subprocess
    import sys

    try:
        glibc = hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2")
    except OSError:
        glibc = False
    if not glibc:
        pytest.skip("glibc 2.33 or later only")
    script = """
import ctypes, torch
from bench.machine import keep_every_page
from common.distributed import keep_freed_memory
from planner.count import MMAP_THRESHOLD
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in FIELDS.split()]
mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
mallinfo2.restype = Info
def mapped(nbytes):
    before = mallinfo2().hblkhd
    x = torch.empty(nbytes, dtype=torch.uint8)
    return mallinfo2().hblkhd - before >= nbytes
keep_freed_memory()
print(mapped(MMAP_THRESHOLD), mapped(MMAP_THRESHOLD - (1 << 20)))
keep_every_page()
print(mapped(MMAP_THRESHOLD), mapped(64 << 20))
"""
    ended = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert ended.stdout.split() == ["True", "False", "False", "False"], ended.stdout
