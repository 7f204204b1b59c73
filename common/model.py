"""BabyCNN: the one model every strategy trains, and its blocks (FSDP's units). Its pipeline cut is in
common/pipeline_layout.py.

BabyCNN is an `nn.Sequential` of named layers, so a parameter has the same name (`conv2.weight`,
`fc1.bias`, ...) in the whole model, in a DDP/FSDP-wrapped model and in any pipeline stage. That is what
lets a checkpoint written by one strategy be read by another.
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn


class BabyCNN(nn.Sequential):
    """Two 3x3 convolutions and a two-layer classifier; returns logits (cross_entropy applies softmax).

    Shapes for a 28x28 grayscale input (32x32 RGB works the same way, with 3 input channels):
        x [B, 1, 28, 28] -conv1-> [B, 32, 26, 26] -conv2-> [B, 64, 24, 24] -pool-> [B, 64, 12, 12]
          -flatten-> [B, 9216] -fc1-> [B, 128] -fc2-> [B, classes]
    """

    def __init__(
        self, *, in_channels: int = 1, image_size: int = 28, num_classes: int = 10, dropout: float = 0.0
    ) -> None:
        conv_size = image_size - 4  # two 3x3 convolutions without padding
        pooled = conv_size // 2
        super().__init__(
            OrderedDict(
                [
                    ("conv1", nn.Conv2d(in_channels, 32, kernel_size=3)),
                    ("relu1", nn.ReLU()),
                    ("conv2", nn.Conv2d(32, 64, kernel_size=3)),
                    ("norm", nn.LayerNorm([64, conv_size, conv_size])),
                    ("relu2", nn.ReLU()),
                    ("pool", nn.MaxPool2d(2)),
                    ("flatten", nn.Flatten()),
                    ("fc1", nn.Linear(64 * pooled * pooled, 128)),
                    ("dropout", nn.Dropout(dropout)),
                    ("relu3", nn.ReLU()),
                    ("fc2", nn.Linear(128, num_classes)),
                ]
            )
        )


# BabyCNN's two blocks, by layer name: what `train_fsdp.py --shard-units blocks` shards as one unit each
# (one all-gather, one reduce-scatter per block). fc1 holds 93% of the parameters, so sharding layer by
# layer would gather almost the same peak of full weights while paying 2.5x the collectives. For the same
# reason the default is the whole model as one unit (--shard-units model): two collectives per step.
BLOCKS = {
    "features": ("conv1", "relu1", "conv2", "norm", "relu2", "pool"),
    "classifier": ("flatten", "fc1", "dropout", "relu3", "fc2"),
}


def blocks(model: BabyCNN) -> dict[str, list[nn.Module]]:
    """The layers of each block of `model` (see BLOCKS)."""
    return {name: [model._modules[layer] for layer in layers] for name, layers in BLOCKS.items()}


def build_model(*, seed: int, in_channels: int, image_size: int, num_classes: int, dropout: float) -> BabyCNN:
    """BabyCNN whose initial weights are a function of `seed` alone: identical on every rank and strategy.

    The model is built on the CPU under a private RNG, so neither the device nor anything drawn from the
    global RNG before this call can change the weights; move it to the device afterwards.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BabyCNN(in_channels=in_channels, image_size=image_size, num_classes=num_classes, dropout=dropout)
