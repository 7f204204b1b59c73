"""BabyGPT (--model gpt): a Llama-style decoder language model, the model most readers of this suite train, through
every strategy (docs/language.md). common/model.py builds it with `build_model(model="gpt", ...)`; its sizes are in
common/gpt_sizes.py. Like BabyViT it is an `nn.Sequential` (`embed`, `block0`.., `head`) that says how it is split
(`blocks()`, `tp_plan()`), so no wrap learns a layer name."""

from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
)

from common.gpt_sizes import GPT_SIZES, gpt_heads, gpt_moe

ROPE_THETA = 10000.0  # rotary positions' base (Llama 3 uses 500,000 for its 8,192-token context; ours are short)


def rotary(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rotate each head's pairs of features (i, i + head_dim / 2) by angle position x theta^(-2i / head_dim): the
    product of two rotated vectors depends only on their positions' difference. x [B, heads, T, head_dim];
    computed in fp32 from the tokens' global `positions` [T] (a context-parallel rank's are not 0..T-1)."""
    half = x.shape[-1] // 2
    freqs = ROPE_THETA ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = positions.to(torch.float32)[:, None] * freqs[None, :]  # [T, half]
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x.float()[..., :half], x.float()[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).type_as(x)


class Attention(nn.Module):
    """Causal multi-head attention with rotary positions and grouped key/value heads: q has `heads` heads, k and v
    `kv_heads`, each serving heads / kv_heads query heads. Head counts are read from the projections' outputs, so
    a TP rank that holds 1/tp of q, k and v (whole heads) runs the same code on its heads."""

    def __init__(self, width: int, heads: int, kv_heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.o = nn.Linear(width, width, bias=False), nn.Linear(width, width, bias=False)
        self.k, self.v = (nn.Linear(width, kv_heads * self.head_dim, bias=False) for _ in range(2))
        # train_cp.py's RingAttention (common/ring_attention.py): x holds this rank's tokens of every sequence, and
        # the ring gives their global positions and attends over the other ranks' keys and values
        self.ring = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, D]
        b, t, _ = x.shape
        # [B, T, D] -> [B, heads, T, head_dim], with -1 heads: this rank's (a view of the global count would break)
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        positions = self.ring.positions(t, x.device) if self.ring else torch.arange(t, device=x.device)
        q, k = rotary(q, positions), rotary(k, positions)
        if self.ring:  # context parallelism: causal over the whole sequence, the keys and values passed round
            return self.o(self.ring(q, k, v).transpose(1, 2).reshape(b, t, -1))
        if (groups := q.shape[1] // k.shape[1]) > 1:  # each key/value head serves `groups` query heads in a row
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # a token sees itself and the tokens before it
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwiGLU(nn.Module):
    """Llama's MLP: down(silu(gate(x)) * up(x)); gate and up split by columns under TP, down by rows."""

    def __init__(self, width: int, hidden: int, dropout: float) -> None:
        super().__init__()
        self.gate, self.up = (nn.Linear(width, hidden, bias=False) for _ in range(2))
        self.down, self.dropout = nn.Linear(hidden, width, bias=False), nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.dropout(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    """A pre-norm decoder block: x + attention(RMSNorm(x)), then + SwiGLU(RMSNorm(x)), or with `moe` (the MoE's
    arguments: common/moe.py) + a mixture of experts(RMSNorm(x))."""

    def __init__(self, width: int, heads: int, kv_heads: int, mlp: int, dropout: float, moe: dict | None) -> None:
        super().__init__()
        self.norm1, self.attn = nn.RMSNorm(width, eps=1e-5), Attention(width, heads, kv_heads)
        self.norm2 = nn.RMSNorm(width, eps=1e-5)
        if moe:
            from common.moe import MoE  # only with --experts

            self.mlp: nn.Module = MoE(width, mlp, **moe, dropout=dropout)
        else:
            self.mlp = SwiGLU(width, mlp, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Head(nn.Module):
    """The final RMSNorm and the output layer: a score per token of the vocabulary, at every position."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.norm, self.out = nn.RMSNorm(width, eps=1e-5), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class BabyGPT(nn.Sequential):
    """A decoder language model: tokens [B, T] -embed-> [B, T, D] -block0..-> [B, T, D] -head-> logits [B, T, V],
    position t's the scores of token t + 1. Its blocks are what every strategy splits by: FSDP's units, the
    pipeline's cuts (the embedding with the first, the head with the last), TP's heads and SwiGLU halves."""

    def __init__(
        self,
        *,
        size: str = "baby",
        vocab_size: int = 0,
        seq_len: int = 0,
        dropout: float = 0.0,
        heads: int = 0,
        kv_heads: int = 0,
        moe: dict | None = None,
    ) -> None:
        shape = GPT_SIZES[size]
        vocab = shape.vocab or vocab_size  # a published shape's own, else the data's
        heads, kv_heads = gpt_heads(size, heads, kv_heads)
        # `moe` (--experts): every block's MLP a mixture of experts, each as wide as the dense MLP (common/moe.py);
        # a size with experts (Mixtral's) has its own, and its experts' width
        moe = moe or gpt_moe(shape)
        hidden = (shape.expert_mlp or shape.mlp) if moe else shape.mlp
        blocks = [(f"block{i}", Block(shape.width, heads, kv_heads, hidden, dropout, moe)) for i in range(shape.depth)]
        embed = nn.Embedding(vocab, shape.width)
        super().__init__(OrderedDict([("embed", embed), *blocks, ("head", Head(shape.width, vocab))]))
        self.seq_len, self.tied = seq_len, shape.tied
        for name, p in self.named_parameters():  # GPT-2's: N(0, 0.02), the residual projections scaled by depth
            if p.dim() >= 2:  # (an MoE's experts: [E, D, H] stacked matrices)
                residual = name.endswith(("attn.o.weight", "mlp.down.weight", "experts.down", "shared.down"))
                nn.init.normal_(p, std=0.02 / (2 * shape.depth) ** 0.5 if residual else 0.02)
        if shape.tied:  # GPT-2 scores tokens with its embedding (DDP and FSDP only: a pipeline or TP splits them)
            self.head.out.weight = self.embed.weight

    def blocks(self) -> list[nn.Module]:
        """The decoder blocks, in order: a unit each for FSDP (the embedding and the head stay with the root)."""
        return [layer for name, layer in self.named_children() if name.startswith("block")]

    def attentions(self) -> list[Attention]:
        """Every block's attention: what context parallelism (train_cp.py) gives its ring."""
        return [module for module in self.modules() if isinstance(module, Attention)]

    def moes(self) -> list:
        """Every block's mixture of experts (--experts; none in a dense model): their balance losses join the
        loss (common/moe.py's aux_loss), and expert parallelism (train_ep.py) spreads their experts."""
        from common.moe import MoE

        return [module for module in self.modules() if isinstance(module, MoE)]

    def tp_plan(self, sequence_parallel: bool = False, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
        """Megatron's split of every block: q, k and v by columns (each TP rank its heads and key/value heads),
        the output projection by rows (the ranks' partial outputs summed); SwiGLU's gate and up by columns, down
        by rows. The embedding is split by vocabulary (each rank looks up its rows; the others' give zeros, and the
        sum is the lookup), the output layer by vocabulary too, its logits left split (Shard(-1)) for the loss to
        be computed on the shards (`loss_parallel`: the full logits never exist on one rank). With
        `sequence_parallel`, the RMSNorms and the residual stream run on 1/tp of the tokens (docs/tp.md); without
        `loss_parallel`, the logits are gathered whole on every TP rank (a pipeline's last stage hands them on)."""
        tokens, gathered = Shard(1), Replicate()  # [B, T, D] cut by its tokens, or whole on every TP rank
        summed = tokens if sequence_parallel else gathered  # the row-wise sums: reduce-scattered, or all-reduced
        plan: dict[str, ParallelStyle] = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=summed)}
        for name in (name for name, _ in self.named_children() if name.startswith("block")):
            plan |= {f"{name}.attn.{p}": ColwiseParallel() for p in ("q", "k", "v")}
            plan |= {f"{name}.mlp.{p}": ColwiseParallel() for p in ("gate", "up")}
            plan |= {f"{name}.attn.o": RowwiseParallel(output_layouts=summed)}
            plan |= {f"{name}.mlp.down": RowwiseParallel(output_layouts=summed)}
            if sequence_parallel:  # the norms on this rank's tokens; the attention and the MLP gather them
                plan |= {f"{name}.{norm}": SequenceParallel() for norm in ("norm1", "norm2")}
                gather = PrepareModuleInput(input_layouts=tokens, desired_input_layouts=gathered)
                plan |= {f"{name}.attn": gather, f"{name}.mlp": gather}
        if sequence_parallel:
            plan["head.norm"] = SequenceParallel()
        # the vocabulary split: the logits stay a DTensor sharded by their last dimension, for loss_parallel
        split = {"output_layouts": Shard(-1), "use_local_output": False}  # a DTensor, for loss_parallel
        out = split if loss_parallel else {"output_layouts": gathered}
        plan["head.out"] = ColwiseParallel(input_layouts=summed, **out)
        return plan
