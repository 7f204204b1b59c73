"""BabyGPT (common/gpt.py), its sizes (common/gpt_sizes.py, common/model_sizes.py), its FLOPs and the GPUs' peaks
MFU is taken against (common/throughput.py), and its data (common/language.py): no processes are launched here."""

import functools
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from common.config import Config
from common.errors import ConfigError
from common.gpt import Attention, BabyGPT, rotary
from common.gpt_sizes import GPT_SIZES, PUBLISHED_GPT, GptShape, gpt_parameters
from common.language import COPY_VOCAB, IGNORE, TEST_SHARE, make_copy, read_text
from common.model_sizes import check_gpt_tp, gpt_layers, gpt_vocab
from common.throughput import Throughput, peak_flops
from common.throughput import gpt_flops_per_token as flops_per_token


@functools.cache  # (Llama 3 405B's 126 blocks take seconds to build, even without memory)
def built(size: str, vocab: int = 0, heads: int = 0, kv_heads: int = 0) -> BabyGPT:
    """The model as common/gpt.py builds it, on the meta device: shapes without memory, so Llama 3 405B counts too."""
    with torch.device("meta"):
        return BabyGPT(size=size, vocab_size=vocab, seq_len=64, heads=heads, kv_heads=kv_heads)


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # (a tied weight is one parameter, counted once)


# ------------------------------------------------------------------------------------------------ sizes
@pytest.mark.parametrize("size", sorted(PUBLISHED_GPT))
def test_each_published_shape_has_its_published_parameter_count(size):
    assert count(built(size, 0)) == pytest.approx(PUBLISHED_GPT[size], rel=0.01)


@pytest.mark.parametrize("size", list(GPT_SIZES))
def test_the_counts_agree_with_the_built_model(size):
    for dataset in ("copy", "text") if not GPT_SIZES[size].vocab else ("copy",):
        vocab = gpt_vocab(size, dataset)
        model = built(size, 0 if GPT_SIZES[size].vocab else vocab)  # (a published shape: its own vocabulary)
        assert count(model) == gpt_parameters(GPT_SIZES[size], vocab)
        assert sum(layer.params for layer in gpt_layers(size, dataset)) == count(model)
    assert (model.head.out.weight is model.embed.weight) == GPT_SIZES[size].tied  # GPT-2's output layer


def test_the_count_follows_heads_and_kv_heads():
    shape = GPT_SIZES["baby"]
    for heads, kv_heads in ((8, 2), (4, 1), (16, 16)):
        model = built("baby", COPY_VOCAB, heads=heads, kv_heads=kv_heads)
        assert model.block0.attn.k.out_features == kv_heads * shape.width // heads
        assert count(model) == gpt_parameters(shape._replace(heads=heads, kv_heads=kv_heads), COPY_VOCAB)


def test_the_published_mixtures_of_experts_build_their_experts_and_their_counts():
    # Mixtral 8x7B: 8 experts of 14,336 in each of 32 blocks, a router of width x 8; 46,702,792,704 exactly as its
    # released weights; 8x22B within 1 % of its announced 141 B; DeepSeek-V3's shape, counted but not claimed
    per_block = 2 * 4096**2 + 2 * 4096 * 1024 + 4096 * 8 + 8 * 3 * 4096 * 14336 + 2 * 4096
    assert count(built("mixtral-8x7b")) == 32 * per_block + 2 * 32000 * 4096 + 4096 == 46_702_792_704
    moe = built("mixtral-8x7b").block0.mlp
    assert (moe.top_k, moe.router.out_features, moe.shared) == (2, 8, None)
    assert moe.experts.gate.shape == (8, 4096, 14336) and moe.experts.down.shape == (8, 14336, 4096)
    assert count(built("mixtral-8x22b")) == pytest.approx(141e9, rel=0.01)
    deepseek = built("deepseek-v3-shaped").block0.mlp
    assert deepseek.experts.gate.shape == (256, 7168, 2048) and deepseek.shared.up.shape == (1, 7168, 2048)
    assert deepseek.top_k == 8 and count(built("deepseek-v3-shaped")) == 699_044_426_752
    # the flags see the shape's experts (train_ep.py's checks, the planner), and --experts overrides them
    cfg = Config(model="gpt", model_size="mixtral-8x7b")
    assert (cfg.experts, cfg.top_k, cfg.model_kwargs()["moe"]["experts"]) == (8, 2, 8)
    cfg = Config(model="gpt", model_size="mixtral-8x7b", experts=4, top_k=1)
    with torch.device("meta"):
        flagged = BabyGPT(size="mixtral-8x7b", moe=cfg.model_kwargs()["moe"]).block0.mlp
    assert (flagged.router.out_features, flagged.top_k) == (4, 1)
    assert Config(model="gpt", model_size="baby").experts == 0  # the trainable sizes stay dense


# ------------------------------------------------------------------------------------------------ FLOPs (MFU)
@pytest.mark.parametrize("size", list(GPT_SIZES))
def test_flops_per_token_is_three_times_the_layers_forward(size):
    """6 x N + 12 x depth x width x seq_len: forward and backward of model_sizes' per-layer forward count."""
    for seq_len in (64, 1024):
        forward = sum(layer.flops for layer in gpt_layers(size, "copy", seq_len))
        assert flops_per_token(size, vocab=gpt_vocab(size), seq_len=seq_len) * seq_len == 3 * forward


@pytest.mark.parametrize("size,seq_len,heads", [("baby", 64, (0, 0)), ("baby", 16, (8, 2))])
def test_flops_per_token_is_what_torch_counts(size, seq_len, heads):
    """torch's own count of a training step's matrix multiplies (the attention in its math kernel, a full square
    of scores as the formula has it), on a real forward and backward."""
    model = BabyGPT(size=size, vocab_size=COPY_VOCAB, seq_len=seq_len, heads=heads[0], kv_heads=heads[1])
    tokens = torch.randint(0, COPY_VOCAB, (3, seq_len))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counted:
        model(tokens).sum().backward()
    kw = {"heads": heads[0], "kv_heads": heads[1]}
    assert counted.get_total_flops() == 3 * seq_len * flops_per_token(size, vocab=COPY_VOCAB, seq_len=seq_len, **kw)


@pytest.mark.parametrize("shared", [False, True])
def test_a_mixture_of_experts_counts_the_flops_of_the_experts_each_token_runs_through(shared):
    """--experts 4 --top-k 2: torch counts the router and the two experts each token went to (not the four), as
    flops_per_token does; MFU is then the active parameters', as MoE papers report it."""
    moe = {"experts": 4, "top_k": 2, "shared": shared, "capacity_factor": 0.0, "aux_coef": 0.01}
    model = BabyGPT(size="baby", vocab_size=COPY_VOCAB, seq_len=32, moe=moe)
    tokens = torch.randint(0, COPY_VOCAB, (3, 32))
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counted:
        model(tokens).sum().backward()
    kw = {"experts": 4, "top_k": 2, "shared": shared}
    assert counted.get_total_flops() == 3 * 32 * flops_per_token("baby", vocab=COPY_VOCAB, seq_len=32, **kw)


def test_the_peak_is_the_gpus_in_the_runs_dtype():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756.5e12  # not the SXM's
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32") == 19.5e12  # CUDA cores: torch's default fp32 matmul
    assert peak_flops("NVIDIA A100-SXM4-80GB", "fp32", tf32=True) == 156e12
    assert peak_flops("NVIDIA H200", "fp16") == 989.4e12
    assert peak_flops("Tesla V100-SXM2-16GB", "bf16") is None  # no bf16 tensor cores
    assert peak_flops("NVIDIA A10G", "bf16") is None  # not the A10: unknown, so no MFU rather than a wrong one
    assert peak_flops("NVIDIA L40S", "bf16") == 362.1e12 and peak_flops("NVIDIA L4", "bf16") == 121e12


def test_mfu_is_the_models_flops_over_the_gpus_peak():
    """tokens/s = sequences/s x --seq-len; MFU = FLOPs per token x tokens/s over every GPU's peak (none on a CPU)."""
    throughput = Throughput(Config(model="gpt", precision="bf16"), torch.device("cpu"), world_size=4)
    assert throughput.rates(100.0) == {"tokens_per_s": 6400.0, "mfu": None}
    throughput.peak = peak_flops("NVIDIA H100 80GB HBM3", "bf16")  # what a run on 4 H100s would be given
    mfu = flops_per_token("baby", vocab=COPY_VOCAB, seq_len=64) * 6400.0 / (4 * 989.4e12)
    assert throughput.rates(100.0) == {"tokens_per_s": 6400.0, "mfu": pytest.approx(mfu, rel=1e-12)}


# ------------------------------------------------------------------------------------------------ TP's split
def test_a_vocabulary_that_tp_does_not_divide_is_refused(monkeypatch):
    """Every shape here has power-of-two heads, so an odd TP degree fails on them first: a shape whose heads and
    SwiGLU width 3 ranks split shows the vocabulary's own check (the copy's 128, a file's 256)."""
    monkeypatch.setitem(GPT_SIZES, "odd", GptShape(96, 1, 3, 3, 288, 1024))
    for dataset, data_file, vocab in (("copy", "", 128), ("text", "t.txt", 256)):
        cfg = Config(model="gpt", model_size="odd", strategy="tp", dataset=dataset, data_file=data_file)
        with pytest.raises(ConfigError, match=rf"^--dp: 3 TP ranks do not split the vocabulary \({vocab}: "):
            check_gpt_tp(cfg, 3)
        check_gpt_tp(cfg, 1)


# ------------------------------------------------------------------------------------------------ the model
def test_a_token_sees_only_itself_and_earlier_tokens():
    model = BabyGPT(size="baby", vocab_size=COPY_VOCAB, seq_len=32).eval()
    tokens = torch.randint(0, COPY_VOCAB, (2, 32))
    changed = tokens.clone()
    changed[:, 20] = (tokens[:, 20] + 1) % COPY_VOCAB
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert before.shape == (2, 32, COPY_VOCAB)
    torch.testing.assert_close(after[:, :20], before[:, :20], rtol=0, atol=1e-6)
    assert (after[:, 20:] - before[:, 20:]).abs().amax(dim=-1).min() > 1e-4  # every later position sees it


def test_rotary_scores_depend_only_on_relative_positions():
    """The same query and key at every position: their rotated dot products are a function of i - j alone, and
    shifting every position (a context-parallel rank's slice) changes none of them. Within fp32's rounding: the
    angles are computed in fp32 (2.4e-6 and 9e-5 measured, scores of magnitude ~6)."""
    torch.manual_seed(0)
    q, k = torch.randn(2, 1, 1, 16).expand(2, 1, 24, 16).unbind(0)  # [heads 1, T 24, head_dim 16]
    positions = torch.arange(24)
    scores = rotary(q, positions) @ rotary(k, positions).transpose(-1, -2)  # [1, 24, 24]
    for offset in range(-23, 24):
        diagonal = torch.diagonal(scores[0], offset)
        torch.testing.assert_close(diagonal, diagonal[:1].expand_as(diagonal), rtol=0, atol=2e-5)
    shifted = rotary(q, positions + 1000) @ rotary(k, positions + 1000).transpose(-1, -2)
    torch.testing.assert_close(shifted, scores, rtol=0, atol=1e-3)
    assert (scores[0, 5, 0] - scores[0, 5, 3]).abs() > 0.1  # (and the distance does matter)


def test_grouped_kv_heads_each_serve_their_neighbouring_query_heads():
    """Attention with 8 query heads and 2 key/value heads is multi-head attention whose k and v heads are each
    repeated for 4 consecutive query heads."""
    torch.manual_seed(0)
    grouped, full = Attention(64, heads=8, kv_heads=2), Attention(64, heads=8, kv_heads=8)
    assert grouped.k.weight.shape == grouped.v.weight.shape == (2 * 8, 64)
    with torch.no_grad():
        for name in ("q", "o"):
            getattr(full, name).weight.copy_(getattr(grouped, name).weight)
        for name in ("k", "v"):  # [kv heads x head_dim, width] -> each head's rows 4 times in a row
            weight = getattr(grouped, name).weight.view(2, 8, 64).repeat_interleave(4, dim=0)
            getattr(full, name).weight.copy_(weight.reshape(64, 64))
    x = torch.randn(3, 10, 64)
    torch.testing.assert_close(grouped(x), full(x), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------ the data
def test_the_copy_task_is_the_same_per_seed_and_scores_the_copy():
    tokens, targets = make_copy(50, 16, seed=3)
    again, _ = make_copy(50, 16, seed=3)
    assert torch.equal(tokens, again) and not torch.equal(tokens, make_copy(50, 16, seed=4)[0])
    assert not torch.equal(tokens, make_copy(50, 16, seed=3, test=True)[0])  # the test split: its own stream
    assert tokens.dtype == torch.int64 and tokens.shape == targets.shape == (50, 16)
    assert 0 <= tokens.min() and tokens.max() < COPY_VOCAB
    assert torch.equal(tokens[:, 8:], tokens[:, :8])  # the second half copies the first
    assert (targets[:, :7] == IGNORE).all() and (targets[:, 15] == IGNORE).all()  # the random half cannot be known
    assert torch.equal(targets[:, 7:15], tokens[:, 8:])  # each scored position: the next (copied) token


def test_a_text_file_is_its_bytes_cut_into_sequences_and_next_bytes(tmp_path):
    path = tmp_path / "text.txt"
    data = ("the quick brown fox jumps over the lazy dog. " * 30).encode()
    path.write_bytes(data)
    cut = int(len(data) * (1 - TEST_SHARE))
    for test, part in ((False, data[:cut]), (True, data[cut:])):
        tokens, targets = read_text(str(path), 10, test=test)
        n = (len(part) - 1) // 10
        assert tokens.shape == targets.shape == (n, 10) and n > 0
        assert bytes(tokens.flatten().tolist()) == part[: n * 10]
        assert bytes(targets.flatten().tolist()) == part[1 : n * 10 + 1]  # every next byte


def test_a_file_that_is_no_text_to_train_on_is_one_line(tmp_path):
    cases = {"missing": (None, "is not a file"), "empty": (b"", "is empty"), "binary": (b"ab\0cd" * 100, "not text")}
    cases["short"] = (b"x" * 40, "test split (its last 10 %) holds 4 bytes, fewer than one sequence")
    for name, (content, problem) in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_bytes(content)
        with pytest.raises(ConfigError, match=f"^--data-file: {re.escape(str(path))}.*{re.escape(problem)}"):
            read_text(str(path), 8, test=True)
    path.write_bytes("é".encode() * 300)  # UTF-8 text, not ASCII: bytes all the same
    assert read_text(str(path), 8, test=False)[0].max() > 127
