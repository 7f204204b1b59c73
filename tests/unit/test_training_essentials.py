"""Unit tests of the learning-rate schedules and of gradient clipping's arithmetic (no processes here; the
multi-process parity of clipping is in tests/integration/test_essentials.py)."""

import math

import pytest
import torch

from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.errors import ConfigError
from common.fp16 import LossScaler
from common.training import loss_scaler, lr_at
from common.versions import NEEDS_V
from tests.helpers import needs_torch


def lrs(flags: list[str], steps: int) -> list[float]:
    cfg = parse_config("ddp", flags)
    return [lr_at(step, cfg, last_step=steps) for step in range(1, steps + 1)]


def test_cosine_rises_to_lr_then_never_increases_and_ends_at_min_lr():
    rates = lrs(["--lr-schedule", "cosine", "--min-lr", "1e-5", "--warmup-steps", "5", "--lr", "1e-3"], 40)
    assert rates[:5] == pytest.approx([2e-4, 4e-4, 6e-4, 8e-4, 1e-3])
    assert max(rates) == 1e-3 == rates[4]
    assert all(b <= a for a, b in zip(rates[4:], rates[5:]))
    assert rates[-1] == 1e-5  # exactly, not within a tolerance
    assert rates[22] == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 18 / 35)))


def test_linear_decays_evenly_to_min_lr_and_constant_stays():
    rates = lrs(["--lr-schedule", "linear", "--min-lr", "1e-4", "--warmup-steps", "0", "--lr", "1e-3"], 10)
    assert rates[-1] == 1e-4 and rates[0] < 1e-3
    # (1e-3 - 1e-4) / 10 steps less each step
    assert all(math.isclose(a - b, 9e-5, rel_tol=1e-9) for a, b in zip(rates, rates[1:]))
    assert lrs(["--warmup-steps", "2", "--lr", "1e-3"], 6) == [5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3]


def test_the_rate_depends_on_the_step_alone():
    cfg = parse_config("ddp", ["--lr-schedule", "cosine", "--warmup-steps", "3"])
    in_order = [lr_at(s, cfg, last_step=50) for s in range(1, 51)]
    assert [lr_at(s, cfg, last_step=50) for s in range(50, 0, -1)] == in_order[::-1]  # no state carried
    # a run no longer than its warm-up has nothing to decay: the peak rate, not a division by zero
    assert lrs(["--lr-schedule", "cosine", "--warmup-steps", "5", "--lr", "1e-3"], 5)[-1] == 1e-3


@pytest.mark.parametrize(
    "flags,flag",
    [
        (["--lr-schedule", "step"], "--lr-schedule"),
        (["--min-lr", "1", "--lr", "1e-3"], "--min-lr"),
        (["--min-lr=-1e-5"], "--min-lr"),
        (["--max-grad-norm=-1"], "--max-grad-norm"),
        (["--max-grad-norm", "nan"], "--max-grad-norm"),
    ],
)
def test_bad_values_name_their_flag(flags, flag):
    with pytest.raises(ConfigError, match=f"^{flag}:"):
        parse_config("ddp", flags)


def model_with_grads() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    model(torch.randn(8, 5)).square().sum().backward()
    return model


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 1e6])
def test_clipping_matches_torch(max_norm):
    ours, theirs = model_with_grads(), model_with_grads()
    norm = clip_grad_norm(ours.parameters(), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm if max_norm else float("inf"))
    assert norm == pytest.approx(expected.item(), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-6, atol=0)
    if max_norm == 0.5:
        assert norm > 0.5  # the case clips
        after = torch.linalg.vector_norm(torch.cat([p.grad.flatten() for p in ours.parameters()]))
        assert after.item() == pytest.approx(0.5, rel=1e-5)


def test_bf16_gradients_are_summed_in_fp32():
    grads = [torch.full((4096,), 1e-2, dtype=torch.bfloat16) for _ in range(8)]
    params = [torch.nn.Parameter(torch.zeros(4096, dtype=torch.bfloat16)) for _ in grads]
    for p, g in zip(params, grads):
        p.grad = g
    exact = math.sqrt(8 * 4096 * float(torch.tensor(1e-2, dtype=torch.bfloat16)) ** 2)
    assert clip_grad_norm(params, 0) == pytest.approx(exact, rel=1e-6)


def test_no_gradients_is_a_zero_norm_and_nothing_to_scale():
    assert clip_grad_norm([torch.nn.Parameter(torch.ones(3))], 1.0) == 0.0


V = [pytest.param(s, marks=needs_torch(NEEDS_V)) for s in ("zbv", "dualpipev")]  # (2.12: common/versions.py)


@pytest.mark.parametrize("schedule", ["interleaved-zb", *V])
def test_compile_refuses_the_split_backward_schedules(schedule):
    from runner.layout import check_layout

    with pytest.raises(ConfigError, match=f"^--compile: {schedule} splits each stage's backward"):
        check_layout(parse_config("pippy", ["--compile", "--schedule", schedule, "--stages-per-rank", "2"]), 2)
    check_layout(parse_config("pippy", ["--compile", "--schedule", "interleaved-1f1b", "--stages-per-rank", "2"]), 2)


def test_compile_without_a_cpp_compiler_is_one_line_before_torchrun(monkeypatch, capsys, tmp_path):
    from runner.preflight import main as preflight

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: no g++, no clang++
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(SystemExit) as exit_:
        preflight(["ddp", "--world-size", "4", "--compile", "--device", "cpu"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--compile: inductor's CPU backend needs a C++ compiler" in err, err


# ------------------------------------------------------------------------------------------ fp16 loss scaling
@pytest.mark.parametrize("max_norm", [0.0, 0.5])
def test_unscaling_in_the_clip_is_gradscalers_unscale_then_clip(max_norm):
    """clip_grad_norm(loss_scale=S) gives, bit for bit, what torch.amp.GradScaler's unscale_ followed by clipping
    gives: the scale is a power of two, so dividing by it is exact wherever it happens."""
    scale = 2.0**14
    ours, theirs = model_with_grads(), model_with_grads()
    for p, q in zip(ours.parameters(), theirs.parameters()):
        p.grad.mul_(scale)
        q.grad.mul_(scale)
    norm = clip_grad_norm(ours.parameters(), max_norm, loss_scale=scale)
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(torch.ones(()))  # (GradScaler makes its scale tensor at the first call)
    optimizer = torch.optim.SGD(theirs.parameters(), lr=0.1)
    scaler.unscale_(optimizer)
    expected = clip_grad_norm(theirs.parameters(), max_norm)
    assert norm == expected
    for a, b in zip(ours.parameters(), theirs.parameters()):
        assert torch.equal(a.grad, b.grad)


def test_an_overflowed_gradient_gives_a_non_finite_norm():
    model = model_with_grads()
    next(model.parameters()).grad[0, 0] = float("inf")
    assert not math.isfinite(clip_grad_norm(model.parameters(), 0.5, loss_scale=1024.0))


def test_loss_scaler_follows_gradscalers_rule_and_resumes_exactly():
    """Halve and skip on overflow, double after `interval` finite steps in a row (torch.amp.GradScaler's update),
    compared step by step with GradScaler itself; state_dict carries everything a resume needs."""
    cfg = parse_config("ddp", ["--precision", "fp16", "--loss-scale", "1024", "--loss-scale-growth-interval", "3"])
    ours = LossScaler(cfg)
    theirs = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=3)
    theirs.scale(torch.ones(()))  # (GradScaler makes its scale tensor at the first call)
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    overflows = [True, False, False, False, False, True, False, False, False, False, False, False]
    resumed = None
    for i, overflow in enumerate(overflows):
        param.grad = torch.tensor([float("inf") if overflow else 1.0]) * theirs.get_scale()
        before = param.detach().clone()
        theirs.step(optimizer)  # (SGD: the update is -grad, so a step shows as a change of the parameter)
        theirs.update()
        stepped = not torch.equal(param.detach(), before)
        ours.step(None, float("inf") if overflow else 1.0)
        assert ours.skipped == overflow == (not stepped)
        assert ours.value == theirs.get_scale(), i
        if i == 6:
            resumed = LossScaler(cfg)
            resumed.load_state_dict(ours.state_dict())
        elif resumed:
            resumed.step(None, float("inf") if overflow else 1.0)
            assert resumed.state_dict() == ours.state_dict()
    assert ours.scale(torch.tensor(3.0)).item() == 3.0 * ours.value


def test_loss_scaler_is_inert_without_fp16():
    scaler = loss_scaler(parse_config("ddp", ["--precision", "bf16"]))
    for _ in range(2001):
        scaler.step(None, float("nan"))
    assert (scaler.value, scaler.skipped, scaler.scale(torch.tensor(2.0)).item()) == (1.0, False, 2.0)


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--precision", "fp16", "--loss-scale", "1000"], "--loss-scale: must be a power of two"),
        (["--precision", "fp16", "--loss-scale", "0.5"], "--loss-scale: must be a power of two, 1 or more"),
        (["--precision", "fp16", "--loss-scale", "inf"], "--loss-scale: must be a power of two"),
        (["--precision", "fp16", "--loss-scale-growth-interval", "0"], "--loss-scale-growth-interval: must be at"),
        (["--loss-scale", "1024"], "--loss-scale: only --precision fp16 scales the loss"),
        (["--precision", "bf16", "--loss-scale-growth-interval", "5"], "--loss-scale: only --precision fp16"),
    ],
)
def test_bad_loss_scale_flags_are_one_line(flags, message):
    with pytest.raises(ConfigError, match=f"^{message}"):
        parse_config("tp", flags)
