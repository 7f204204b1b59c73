"""BabyViT (--model vit): a small Vision Transformer on the same images as BabyCNN, whose blocks are what every
strategy splits by (docs/transformer.md). common/model.py builds it with `build_model(model="vit", ...)`."""

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

from common.model_sizes import check_vit
from common.vit_sizes import VIT_SIZES


class Attention(nn.Module):
    """Multi-head self-attention with separate q, k and v projections, so that splitting their outputs by columns
    keeps whole heads; the head count is read from the output's width (a TP rank holds width / tp of it)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.proj = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [B, T, D]
        b, t, _ = x.shape
        # [B, T, D] -> [B, heads, T, head_dim], with -1 heads: this rank's (a view of the global count would break)
        q, k, v = (f(x).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    """A pre-norm transformer block: x + attention(LayerNorm(x)), then + MLP(LayerNorm(x)) with GELU."""

    def __init__(self, width: int, heads: int, mlp: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2 = nn.LayerNorm(width), Attention(width, heads), nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            OrderedDict(
                fc1=nn.Linear(width, mlp), act=nn.GELU(), dropout=nn.Dropout(dropout), fc2=nn.Linear(mlp, width)
            )
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    """Image to tokens: a strided convolution cuts it into patches and projects each, plus a learned position."""

    def __init__(self, channels: int, image_size: int, patch: int, width: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels, width, kernel_size=patch, stride=patch)
        # [T, D], broadcast over the batch: FSDP shards dim 0, which a leading 1 would leave whole on rank 0
        self.pos = nn.Parameter(0.02 * torch.randn((image_size // patch) ** 2, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [B, C, H, W] -> [B, T, D]
        # contiguous: the tokens' layout, which every later sum keeps, and a pipeline sends (gloo wants it dense)
        return self.conv(x).flatten(2).transpose(1, 2).contiguous() + self.pos


class Head(nn.Module):
    """The final LayerNorm, the mean over the tokens and the classifier."""

    def __init__(self, width: int, num_classes: int) -> None:
        super().__init__()
        self.norm, self.fc = nn.LayerNorm(width), nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.norm(x).mean(dim=1))


class BabyViT(nn.Sequential):
    """A Vision Transformer: x [B, C, H, W] -embed-> [B, T, D] (T = (H / patch)^2 tokens) -block0..-> [B, T, D]
    -head-> [B, classes]. Its blocks are what every strategy splits by: FSDP's units, the pipeline's cuts,
    checkpointing's spans, tensor parallelism's heads and MLP halves (docs/transformer.md)."""

    def __init__(
        self,
        *,
        size: str = "baby",
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        dropout: float = 0.0,
        patch_size: int = 0,
        heads: int = 0,
    ) -> None:
        check_vit(size, image_size, patch=patch_size, heads=heads)  # (one line, before any weight is drawn)
        patch, width, depth, own_heads, mlp = VIT_SIZES[size]
        blocks = [(f"block{i}", Block(width, heads or own_heads, mlp, dropout)) for i in range(depth)]
        embed = PatchEmbed(in_channels, image_size, patch_size or patch, width)
        super().__init__(OrderedDict([("embed", embed), *blocks, ("head", Head(width, num_classes))]))

    def blocks(self) -> list[nn.Module]:
        """The transformer blocks, in order: a unit each for FSDP (the embedding and the head stay with the root)."""
        return [layer for name, layer in self.named_children() if name.startswith("block")]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Megatron's split of every block: q, k and v by columns (each TP rank its heads), the attention's output
        projection by rows (the ranks' partial outputs summed); the MLP's first layer by columns, its second by rows.
        With `sequence_parallel`, what runs between them runs on this rank's 1/tp of the tokens: the LayerNorms
        and the residual stream; an all-gather of the tokens before the attention and the MLP, whose output sums
        become reduce-scatters (docs/tp.md). The embedding and the head run whole on every rank either way."""
        plan: dict[str, ParallelStyle] = {}
        tokens, gathered = Shard(1), Replicate()  # [B, T, D] cut by its tokens, or whole on every TP rank
        summed = tokens if sequence_parallel else gathered  # the row-wise sums: reduce-scattered, or all-reduced
        for name in (name for name, _ in self.named_children() if name.startswith("block")):
            plan |= {f"{name}.attn.{p}": ColwiseParallel() for p in ("q", "k", "v")}
            plan |= {f"{name}.attn.proj": RowwiseParallel(output_layouts=summed), f"{name}.mlp.fc1": ColwiseParallel()}
            plan[f"{name}.mlp.fc2"] = RowwiseParallel(output_layouts=summed)
            if sequence_parallel:  # the norms on this rank's tokens; the attention and the MLP gather them
                plan |= {f"{name}.{norm}": SequenceParallel() for norm in ("norm1", "norm2")}
                gather = PrepareModuleInput(input_layouts=tokens, desired_input_layouts=gathered)
                plan |= {f"{name}.attn": gather, f"{name}.mlp": gather}
        if sequence_parallel:  # the embedding's output cut by tokens (no traffic), the head's input gathered
            plan["block0"] = PrepareModuleInput(
                input_layouts=gathered, desired_input_layouts=tokens, use_local_output=True
            )
            plan["head"] = PrepareModuleInput(
                input_layouts=tokens, desired_input_layouts=gathered, use_local_output=True
            )
        return plan
