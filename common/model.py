"""The models every strategy trains, BabyCNN here and BabyViT in common/vit.py (--model vit), and how each is split:
its blocks (FSDP's units) and its tensor-parallel plan, which the scripts hand to their wraps (each size in numbers,
and the pipeline's cut: common/model_sizes.py). Each is an `nn.Sequential` of named layers: a parameter has one name
(`fc1.bias`, `block2.attn.q.weight`) whole, wrapped or in a pipeline stage, so one strategy's checkpoint loads into
another."""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from common.config import MODEL_SIZES

if TYPE_CHECKING:
    from common.gpt import BabyGPT
    from common.vit import BabyViT


class BabyCNN(nn.Sequential):
    """Two 3x3 convolutions and a classifier; returns logits (cross_entropy applies softmax). x [B, 1, 28, 28]
    -conv1-> [B, 32, 26, 26] -conv2-> [B, 64, 24, 24] -pool-> [B, 64, 12, 12] -flatten-> [B, 9216] -fc1-> [B, W]
    (-hidden1..-> [B, W]) -fc2-> [B, classes]; W: the size's width (baby: 128, no hidden layer)."""

    def __init__(
        self,
        *,
        size: str = "baby",
        in_channels: int = 1,
        image_size: int = 28,
        num_classes: int = 10,
        dropout: float = 0.0,
    ) -> None:
        width, depth = MODEL_SIZES[size]
        conv_size = image_size - 4  # two 3x3 convolutions without padding
        pooled = conv_size // 2
        layers = [
            ("conv1", nn.Conv2d(in_channels, 32, kernel_size=3)),
            ("relu1", nn.ReLU()),
            ("conv2", nn.Conv2d(32, 64, kernel_size=3)),
            ("norm", nn.LayerNorm([64, conv_size, conv_size])),
            ("relu2", nn.ReLU()),
            ("pool", nn.MaxPool2d(2)),
            ("flatten", nn.Flatten()),
            ("fc1", nn.Linear(64 * pooled * pooled, width)),
            ("dropout", nn.Dropout(dropout)),
            ("relu3", nn.ReLU()),
        ]
        for i in range(1, depth):  # a stack of equal layers: FSDP units, places to cut the pipeline
            layers += [(f"hidden{i}", nn.Linear(width, width)), (f"relu_hidden{i}", nn.ReLU())]
        super().__init__(OrderedDict([*layers, ("fc2", nn.Linear(width, num_classes))]))

    def blocks(self) -> list[list[nn.Module]]:
        """The model in consecutive blocks of layers, FSDP's units (`--shard-units blocks`): the features, then the
        classifier, whole for baby (its fc1 holds 93 % of the parameters: a layer at a time would gather almost the
        same peak for 2.5x the collectives), a layer at a time for the larger sizes (fc2 with the last)."""
        names = list(self._modules)
        starts = [0, names.index("flatten"), *(i for i, name in enumerate(names) if name.startswith("hidden"))]
        return [[self._modules[n] for n in names[a:b]] for a, b in zip(starts, [*starts[1:], len(names)])]

    def tp_plan(self, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
        """Tensor parallelism's plan: the classifier's linear layers in pairs, the first split by its outputs
        (column-wise), the second by its inputs (row-wise: the TP ranks' partial outputs are summed), as Megatron
        splits an MLP. An odd last one and the convolutions stay whole on every TP rank (no `sequence_parallel`)."""
        linears = [name for name, layer in self.named_children() if isinstance(layer, nn.Linear)]
        pairs = zip(linears[0::2], linears[1::2])
        return {name: style() for pair in pairs for name, style in zip(pair, (ColwiseParallel, RowwiseParallel))}


def build_model(*, model: str = "cnn", seed: int, **kwargs: object) -> BabyCNN | BabyViT | BabyGPT:
    """BabyCNN, BabyViT or BabyGPT (`model`) whose initial weights are a function of `seed` and the size alone, the
    same on every rank and in every strategy: built on the CPU under a private RNG (move it to the device
    afterwards). `kwargs`: the model's (size, dropout; the images' in_channels, image_size, num_classes; the ViT's
    patch_size and heads; BabyGPT's vocab_size, seq_len, heads and kv_heads)."""
    model_class: type[nn.Module] = BabyCNN
    if model == "vit":
        from common.vit import BabyViT as model_class  # only with --model vit: a CNN run carries no transformer
    if model == "gpt":
        from common.gpt import BabyGPT as model_class
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return model_class(**kwargs)
