"""DDP and FSDP planned side by side on a GPU (planner/count.py, planner/timing.py), data parallel on one node: the
same FLOPs are the same matmuls at the same rate; FSDP's optimizer updates its share of the parameters; in forward
and backward DDP computes no more than FSDP but for what autocast adds (its casts, the operators it keeps in fp32),
so its step is slower than FSDP's by no more than that, its exposed communication and the optimizer FSDP shards.
And the bytes an operator is counted as moving: what it reads and what it writes."""

from __future__ import annotations

from typing import Callable

import pytest
import torch

from common.config import Config
from common.versions import NEEDS_PLANNER
from planner.count import MMAP_THRESHOLD, Op, StepCount, StepCounter
from tests.helpers import needs_torch

pytestmark = needs_torch(NEEDS_PLANNER)

WORLD = 2  # two GPUs of one node: NVLink, where DDP's all-reduce hides behind backward
VARIANTS = ("ddp", "fsdp full, one unit")
PRECISIONS = ("fp32", "fp16")


@pytest.fixture(scope="module")
def planned() -> dict:
    """{(variant, precision): (rank 0's counted step, the predicted step)}: BabyCNN medium (155 M parameters), 32 a
    GPU, on the A100 profile; and the profile under "profile"."""
    from planner.plan import counted_steps, variant_config
    from planner.timing import load_profile, predict

    profile = load_profile("a100-sxm")
    found: dict = {"profile": profile}
    for precision in PRECISIONS:
        base = Config(model_size="medium", batch_size=32 * WORLD, precision=precision)
        for variant in VARIANTS:
            cfg = variant_config(variant, base, WORLD)
            counts = counted_steps(cfg, WORLD)
            found[variant, precision] = (counts[0], predict(cfg, WORLD, counts, profile))
    return found


def seconds(planned: dict, count: StepCount, which: Callable[[Op], bool]) -> float:
    """The compute the profile charges the operators of `count` that `which` picks."""
    compute = planned["profile"].for_threads(1)
    return sum(op.calls * compute.op_time(op) for op in count.ops.values() if which(op))


def forward_and_backward(step) -> float:  # (the slowest rank's: FSDP's ranks may hold uneven shards)
    return max(r.compute["forward"] + r.compute["backward"] for r in step.ranks)


def optimizer(step) -> float:
    return max(r.compute["optimizer"] for r in step.ranks)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_same_flops_are_the_same_matmuls_at_the_same_rate(planned, precision):
    # FSDP's param_dtype and DDP's autocast put the same operators in the low precision: the GPU's rate is that
    # dtype's for both (a matmul counted in fp32 for one of them would run 16 x slower on the A100 profile)
    ddp, fsdp = (planned[v, precision][0] for v in VARIANTS)
    for phase in ("forward", "backward"):
        kinds = [
            {
                (op.name, op.dtype, op.shapes): op.flops * op.calls
                for op in c.ops.values()
                if op.flops and op.phase == phase
            }
            for c in (ddp, fsdp)
        ]
        assert kinds[0] == kinds[1] and ddp.flops(phase) == fsdp.flops(phase) > 0, phase
        assert {dtype for _, dtype, _ in kinds[0]} == {precision}
        work = [seconds(planned, c, lambda op, phase=phase: op.flops > 0 and op.phase == phase) for c in (ddp, fsdp)]
        assert work[0] == pytest.approx(work[1], rel=1e-12) and work[0] > 0


def test_fsdp_updates_its_share_of_the_parameters(planned):
    # DDP's AdamW updates every parameter on every rank, FSDP's this rank's shard: half the bytes on 2 ranks
    for precision in PRECISIONS:
        ddp, fsdp = (planned[v, precision][0] for v in VARIANTS)
        adamw = [
            sum(op.bytes * op.calls for op in c.ops.values() if op.name == "aten._fused_adamw_") for c in (ddp, fsdp)
        ]
        assert adamw[1] == pytest.approx(adamw[0] / WORLD, rel=1e-3) and adamw[1] > 0
        assert optimizer(planned[VARIANTS[1], precision][1]) < optimizer(planned[VARIANTS[0], precision][1])


@pytest.mark.parametrize("precision", PRECISIONS)
def test_ddp_computes_no_more_than_fsdp_but_for_autocast(planned, precision):
    # FSDP runs DDP's operators and its own copies in and out of its buffers; DDP's one copy of each gradient into
    # its bucket moves the bytes of FSDP's copy into the reduce-scatter. Under fp16 DDP's autocast casts each weight
    # and each matmul's input, and keeps the gradients and what is not a matmul or a convolution in fp32, where FSDP
    # computes in fp16: at most the casts and half of those operators (what fp16 would save them) more than FSDP
    (ddp, ddp_step), (_, fsdp_step) = (planned[v, precision] for v in VARIANTS)
    autocast = 0.0
    if precision != "fp32":
        casts = seconds(planned, ddp, lambda op: op.phase != "optimizer" and op.name == "aten._to_copy")
        kept = seconds(
            planned,
            ddp,
            lambda op: op.phase != "optimizer" and op.name != "aten._to_copy" and op.dtype == "fp32" and not op.flops,
        )
        autocast = casts + kept / 2
        assert casts > 0 and kept > 0
    assert forward_and_backward(ddp_step) <= forward_and_backward(fsdp_step) + autocast
    # so the step: DDP's slower than FSDP's by no more than autocast, its exposed all-reduce and the optimizer's
    # share FSDP does not update
    sharded = optimizer(ddp_step) - optimizer(fsdp_step)
    assert ddp_step.step_s <= fsdp_step.step_s + autocast + ddp_step.exposed_s + sharded + 1e-12


def test_ddp_all_reduces_its_gradients_in_buckets_beside_backward(planned):
    # a run's steps after its first: DDP's buckets of 25 MiB (a parameter larger than that alone in its own), each
    # all-reduced as backward fills it; on NVLink backward hides all but the last
    from common.model_sizes import parameter_count

    ddp, step = planned["ddp", "fp32"]
    buckets = [c for c in ddp.collectives if not c.logged]
    assert len(buckets) > 2 and {(c.kind, c.phase) for c in buckets} == {("all_reduce", "backward")}
    assert sum(c.bytes for c in buckets) == 4 * parameter_count("medium", "digits", "cnn")
    assert step.exposed_s < step.communication_s / 2


def counted(run: Callable[[], object]) -> dict[str, Op]:
    with StepCounter() as counter:
        run()
    return {op.name: op for op in counter.count.ops.values()}


def test_an_operator_moves_what_it_reads_and_writes():
    n = 1000  # floats: 4,000 bytes a tensor
    a, b, c = torch.zeros(n), torch.ones(n), torch.empty(n)
    m = torch.ones(10, 10)
    ops = counted(lambda: (a.copy_(b), torch.add(a, b, out=c), a.add_(b), torch.mm(m, m), c.fill_(2.0)))
    assert ops["aten.copy_"].bytes == 8_000  # reads its source, writes its destination (not read: overwritten)
    assert ops["aten.add"].bytes == 12_000  # out=: written, not read
    assert ops["aten.add_"].bytes == 12_000  # in place: its destination read and written
    assert ops["aten.mm"].bytes == 1_200
    assert ops["aten.fill_"].bytes == 4_000


def test_fsdp_s_copy_in_writes_its_shards_slice_of_the_buffer_and_makes_no_storage():
    import torch.distributed.fsdp._fully_shard._fsdp_collectives  # noqa: F401  (defines torch.ops.fsdp)

    shard = MMAP_THRESHOLD // 4 // WORLD  # floats: the all-gather buffer of WORLD shards is MMAP_THRESHOLD bytes
    inputs = [torch.ones(shard // 4), torch.ones(shard - shard // 4)]

    def copy_in() -> None:
        buffer = torch.empty(WORLD * shard)
        torch.ops.fsdp.all_gather_copy_in(inputs, buffer, [t.numel() for t in inputs], shard, 1)

    ops = counted(copy_in)
    # reads the shards and writes them into rank 1's slice: not the whole buffer, which the all-gather fills
    assert ops["fsdp.all_gather_copy_in"].bytes == 2 * 4 * shard
    # the buffer's pages are new once, where `empty` made it, not again where the copy-in hands it back
    assert ops["aten.empty"].fresh_bytes == MMAP_THRESHOLD and ops["fsdp.all_gather_copy_in"].fresh_bytes == 0
