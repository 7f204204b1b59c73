"""BabyGPT's sizes, loaded only with --model gpt: --model-size -> GptShape. The first three train here on the built-in
language or a text file (their vocabulary is the data's); the published shapes (GPT-2 124M, Llama 3 8B, 70B, 405B,
and the mixtures of experts Mixtral 8x7B, 8x22B and a DeepSeek-V3-shaped one) are for python -m planner, with their
own vocabularies. No torch here: the runners check a size before torchrun."""

from __future__ import annotations

from typing import NamedTuple

from common.errors import ConfigError


class GptShape(NamedTuple):
    width: int
    depth: int
    heads: int
    kv_heads: int  # grouped key/value heads: each serves heads / kv_heads query heads (Llama 3: 8)
    mlp: int  # SwiGLU's hidden width
    context: int  # the longest --seq-len its rotary positions are meant for (the published context)
    vocab: int = 0  # 0: the data's (the built-in language's, or 256 bytes of a text file)
    tied: bool = False  # the output layer is the embedding (GPT-2); Llama's are two matrices
    experts: int = 0  # a mixture of experts in every block in place of its MLP (common/moe.py); 0: dense
    top_k: int = 0  # the experts each token is routed to (with experts)
    expert_mlp: int = 0  # each expert's SwiGLU hidden width (0: mlp's, as Mixtral's and --experts on a dense size)
    shared: bool = False  # also a shared expert of that width that every token runs through (DeepSeek's)


GPT_SIZES = {
    # 0.1 M parameters: trains in about a minute on 2 CPU cores; rotary positions to 16 k tokens, for CP's lengths
    "baby": GptShape(64, 2, 4, 4, 192, 16384),
    "small": GptShape(256, 6, 8, 4, 704, 4096),  # 4.5 M
    "medium": GptShape(1024, 16, 16, 8, 2816, 4096),  # 189 M
    # GPT-2 small's shape as a Llama-style decoder: rotary positions instead of its 1,024 learned ones, SwiGLU of
    # the same parameters as its 4 x 768 GELU MLP (3 x 2,048), RMSNorm, no biases: 123.6 M against the published
    # 124.4 M (-0.7 %: the learned positions and biases it lacks)
    "gpt2-124m": GptShape(768, 12, 12, 12, 2048, 1024, vocab=50257, tied=True),
    "llama3-8b": GptShape(4096, 32, 32, 8, 14336, 8192, vocab=128256),  # 8.03 B
    "llama3-70b": GptShape(8192, 80, 64, 8, 28672, 8192, vocab=128256),  # 70.6 B
    "llama3-405b": GptShape(16384, 126, 128, 8, 53248, 8192, vocab=128256),  # 405.9 B
    # Mixtral (Mistral AI, 2024): Llama-style blocks, each MLP 8 SwiGLU experts of the dense width, 2 per token
    "mixtral-8x7b": GptShape(4096, 32, 32, 8, 14336, 32768, vocab=32000, experts=8, top_k=2),  # 46.7 B
    "mixtral-8x22b": GptShape(6144, 56, 48, 8, 16384, 65536, vocab=32768, experts=8, top_k=2),  # 140.6 B
    # shaped like DeepSeek-V3 (256 routed experts of 2,048 + 1 shared, 8 per token, 61 blocks of width 7,168), not
    # it: GQA with 8 key/value heads in place of its MLA attention, and every block a mixture where its first 3 are
    # dense (of 18,432): 699.1 B against its published 671 B (+4 %), so no published count is claimed for it
    "deepseek-v3-shaped": GptShape(
        7168, 61, 128, 8, 18432, 131072, vocab=129280, experts=256, top_k=8, expert_mlp=2048, shared=True
    ),
}
PUBLISHED_GPT = {  # size -> the parameter count its authors publish
    "gpt2-124m": 124_439_808,  # Radford et al. 2019, the 124 M checkpoint's count
    "llama3-8b": 8_030_261_248,  # Llama 3 model card (Meta, 2024): "8B", counted from the released weights
    "llama3-70b": 70_553_706_496,
    "llama3-405b": 405_853_388_800,
    "mixtral-8x7b": 46_702_792_704,  # Mixtral 8x7B's release (Mistral AI, 2024), counted from the released weights
    # Mixtral 8x22B's release (Mistral AI, 2024): "141B" (its Instruct v0.1's shape, vocabulary 32,768: 140.63 B)
    "mixtral-8x22b": 141_000_000_000,
}


def gpt_heads(size: str, heads: int = 0, kv_heads: int = 0) -> tuple[int, int]:
    """(query heads, key/value heads) of --heads and --kv-heads: 0 is the size's own, and --heads alone gives as
    many key/value heads (plain multi-head attention)."""
    return heads or GPT_SIZES[size].heads, kv_heads or heads or GPT_SIZES[size].kv_heads


def gpt_moe(shape: GptShape) -> dict | None:
    """common/moe.py's MoE arguments of a size with experts (dropless, the balance loss at --aux-loss-coef's
    default), or None for a dense size: BabyGPT builds a published mixture of experts with no flags."""
    if not shape.experts:
        return None
    own = {"experts": shape.experts, "top_k": shape.top_k, "shared": shape.shared}
    return own | {"capacity_factor": 0.0, "aux_coef": 0.01}


def expert_parameters(shape: GptShape, experts: int = 0) -> int:
    """One block's experts (`experts`, 0: the shape's; routed, then the shared one): three matrices each."""
    hidden = shape.expert_mlp or shape.mlp
    return ((experts or shape.experts) + shape.shared) * 3 * shape.width * hidden


def gpt_parameters(shape: GptShape, vocab: int) -> int:
    """Parameters of BabyGPT of `shape` over a vocabulary of `vocab` tokens (common/gpt.py builds the same): the
    embedding, per block two RMSNorms, q and the output projection (width x width), k and v (width x the key/value
    heads' width) and SwiGLU's three matrices (a mixture of experts: the router, width x experts, and every
    expert's three), then the final RMSNorm and the output layer (none if tied)."""
    head_dim = shape.width // shape.heads
    attention = 2 * shape.width * shape.width + 2 * shape.width * shape.kv_heads * head_dim
    mlp = shape.width * shape.experts + expert_parameters(shape) if shape.experts else 3 * shape.width * shape.mlp
    block = attention + mlp + 2 * shape.width
    return vocab * shape.width * (1 if shape.tied else 2) + shape.depth * block + shape.width


def check_gpt(
    size: str, *, heads: int, kv_heads: int, seq_len: int, dataset: str, data_file: str, patch_size: int, strategy: str
) -> None:
    """ConfigError unless BabyGPT's flags fit its shape: --heads divide the width, --kv-heads divide --heads,
    --seq-len within the context its rotary positions are for (the built-in copy: even), a tied
    output layer (GPT-2's) only where one rank holds both ends of the model. The runners check it before torchrun,
    Config.check in the workers."""
    if patch_size:
        raise ConfigError("--patch-size: a flag of the ViT (--model vit); BabyGPT reads tokens, not patches")
    if (dataset == "text") != bool(data_file):
        raise ConfigError(
            "--data-file: --dataset text trains on a file; give --data-file PATH"
            if not data_file
            else f"--data-file: a file is --dataset text, not {dataset}; drop --dataset"
        )
    shape = GPT_SIZES[size]
    heads, kv_heads = gpt_heads(size, heads, kv_heads)
    if shape.width % heads:
        fits = ", ".join(str(h) for h in range(1, min(shape.width, 64) + 1) if shape.width % h == 0)
        raise ConfigError(f"--heads: {heads} heads do not divide the width {shape.width}; use one of {fits}")
    if heads % kv_heads:
        fits = ", ".join(str(k) for k in range(1, heads + 1) if heads % k == 0)
        raise ConfigError(
            f"--kv-heads: {kv_heads} key/value heads do not divide the {heads} query heads; use one of {fits}"
        )
    if seq_len > shape.context:
        raise ConfigError(
            f"--seq-len: {seq_len} tokens are beyond {size}'s context of {shape.context} (its rotary "
            f"positions' length); use --seq-len {shape.context} or less, or a larger --model-size"
        )
    if dataset == "copy" and seq_len % 2:
        raise ConfigError(
            f"--seq-len: the built-in copy needs an even length (random tokens, then the same again), got {seq_len}"
        )
    if shape.tied and (strategy == "pippy" or strategy == "tp"):
        raise ConfigError(
            f"--model-size {size}: its output layer is its embedding (tied, as GPT-2's), which a "
            f"{'pipeline puts in different stages' if strategy == 'pippy' else 'TP would split twice'}; train it "
            f"with DDP or FSDP, or choose an untied size (baby, small, medium, llama3-8b ...)"
        )
