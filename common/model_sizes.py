"""The models' sizes as numbers: the layers of each `--model` and `--model-size`, their parameters and FLOPs, and
where a pipeline cuts them into stages of equal cost. No torch here, so the runners can tell before torchrun
starts whether a run fits in memory and how many stages a size allows; common/model.py builds the layers.

BabyCNN keeps its two convolutions at every size and grows the classifier (a first layer from the features to
`width`, `depth - 1` hidden layers of `width` x `width`, the output layer); BabyViT is a patch embedding, blocks
of attention and MLP, and a head. A pipeline cuts BabyCNN between layers, BabyViT between blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.config import MODEL_SIZES, Config
from common.errors import ConfigError
from common.gpt_sizes import GPT_SIZES, gpt_heads, gpt_parameters
from common.vit_sizes import VIT_SIZES

# The input each data set gives the model: channels, image side, classes.
DATASET_SHAPES = {"digits": (1, 28, 10), "mnist": (1, 28, 10), "fashion-mnist": (1, 28, 10), "cifar10": (3, 32, 10)}
PUBLISHED = ("ti16", "s16", "b16", "l16", "h14", "g14", "22b")  # the ViTs planned at 224 x 224, 1,000 classes


def check_vit(size: str, side: int, *, patch: int = 0, heads: int = 0) -> None:
    """ConfigError unless --patch-size (0: the size's) divides the images' `side` and --heads (0: the size's) the
    width: the runners check it before torchrun, BabyViT when it is built."""
    own_patch, width, _, own_heads, _ = VIT_SIZES[size]
    patch, heads = patch or own_patch, heads or own_heads
    if side % patch:
        fits = ", ".join(str(p) for p in range(2, side) if side % p == 0)
        raise ConfigError(
            f"--patch-size: {patch} does not divide the images' {side} pixels (--model-size {size}); use "
            f"--patch-size {fits}, or a size that trains here (baby, small, medium, large; the published ones are "
            f"for python -m planner)"
        )
    if width % heads:
        fits = ", ".join(str(h) for h in range(1, min(width, 64) + 1) if width % h == 0)
        raise ConfigError(f"--heads: {heads} heads do not divide the width {width}; use one of {fits}")


def gpt_vocab(size: str, dataset: str = "copy") -> int:
    """BabyGPT's vocabulary: a published shape's own, else the data's (the built-in copy's 128, a file's 256
    bytes; common/language.py)."""
    return GPT_SIZES[size].vocab or (256 if dataset == "text" else 128)


def input_shape(model: str, size: str, dataset: str = "digits") -> tuple[int, int, int]:
    """(channels, image side, classes) the model is built for: the data set's, or the published ViTs' ImageNet."""
    return (3, 224, 1000) if model == "vit" and size in PUBLISHED else DATASET_SHAPES[dataset]


@dataclass(frozen=True)
class Layer:
    name: str
    params: int
    flops: int  # forward FLOPs per sample (2 x multiply-adds of a convolution or a linear layer; 0 for the rest)
    outputs: int  # output values per sample (0 for flatten, a view)


def layers(size: str, dataset: str = "digits", model: str = "cnn") -> list[Layer]:
    """Every layer of the model at `size` for `dataset`'s images, in order (common/model.py builds the same)."""
    if model == "vit":
        return vit_layers(size, dataset)
    if model == "gpt":
        return gpt_layers(size, dataset)
    width, _ = MODEL_SIZES[size]
    channels, side, classes = DATASET_SHAPES[dataset]
    conv = side - 4  # two 3x3 convolutions without padding
    features = 64 * (conv // 2) ** 2
    conv1, conv2, pooled = 32 * (side - 2) ** 2, 64 * conv**2, features
    out = [
        Layer("conv1", 32 * channels * 9 + 32, 2 * conv1 * channels * 9, conv1),
        Layer("relu1", 0, 0, conv1),
        Layer("conv2", 64 * 32 * 9 + 64, 2 * conv2 * 32 * 9, conv2),
        Layer("norm", 2 * conv2, 0, conv2),
        Layer("relu2", 0, 0, conv2),
        Layer("pool", 0, 0, pooled),
        Layer("flatten", 0, 0, 0),
        Layer("fc1", features * width + width, 2 * features * width, width),
        Layer("dropout", 0, 0, width),
        Layer("relu3", 0, 0, width),
    ]
    for name in (f"hidden{i}" for i in range(1, MODEL_SIZES[size][1])):  # as common/model.py names them
        out += [Layer(name, width * width + width, 2 * width * width, width), Layer(f"relu_{name}", 0, 0, width)]
    return [*out, Layer("fc2", width * classes + classes, 2 * width * classes, classes)]


def vit_layers(size: str, dataset: str = "digits") -> list[Layer]:
    """BabyViT's layers: the patch embedding (a strided convolution and a learned position per token), the blocks
    (LayerNorm, attention with q, k, v and an output projection, LayerNorm, MLP; each with its residual) and the
    head (LayerNorm, the tokens' mean, a linear layer). `outputs`: the values a block keeps for backward, about."""
    patch, width, depth, heads, mlp = VIT_SIZES[size]
    channels, side, classes = input_shape("vit", size, dataset)
    tokens = (side // patch) ** 2
    embed = Layer(
        "embed",
        channels * patch * patch * width + width + tokens * width,
        2 * tokens * channels * patch * patch * width,
        tokens * width,
    )
    block_params = 4 * (width * width + width) + 4 * width + 2 * width * mlp + mlp + width
    block_flops = 2 * tokens * (4 * width * width + 2 * width * mlp) + 4 * tokens * tokens * width
    kept = tokens * (7 * width + 2 * mlp) + heads * tokens * tokens  # LayerNorms, q k v, attention, MLP, residuals
    block = [Layer(f"block{i}", block_params, block_flops, kept) for i in range(depth)]
    head = Layer("head", 2 * width + width * classes + classes, 2 * width * classes, tokens * width + classes)
    return [embed, *block, head]


def gpt_layers(size: str, dataset: str = "copy", seq_len: int = 64) -> list[Layer]:
    """BabyGPT's layers at `seq_len` tokens: the embedding (a lookup: no FLOPs), the blocks (RMSNorm, attention
    with q, k, v, the output projection and the causal scores, RMSNorm, SwiGLU; counted as a full square of scores,
    as the kernel computes it), and the head (RMSNorm, the output layer over the vocabulary). `outputs`: the values
    a block keeps for backward, about; the head's logits. Per sequence."""
    shape, vocab, t = GPT_SIZES[size], gpt_vocab(size, dataset), seq_len
    block_params = (gpt_parameters(shape, vocab) - shape.width - vocab * shape.width * (1 + (not shape.tied))) // max(
        shape.depth, 1
    )
    kv = shape.width // shape.heads * shape.kv_heads
    matmuls = 2 * shape.width * shape.width + 2 * shape.width * kv + 3 * shape.width * shape.mlp
    block_flops = 2 * t * matmuls + 4 * t * t * shape.width
    # norms, q k v, the attention's output and log-sum-exp (SDPA's fused kernels keep no [T, T] scores), SwiGLU
    kept = t * (6 * shape.width + 2 * kv + 3 * shape.mlp) + shape.heads * t
    embed = Layer("embed", vocab * shape.width, 0, t * shape.width)
    blocks = [Layer(f"block{i}", block_params, block_flops, kept) for i in range(shape.depth)]
    out_params = shape.width + (0 if shape.tied else vocab * shape.width)  # a tied output layer is the embedding
    return [embed, *blocks, Layer("head", out_params, 2 * t * shape.width * vocab, t * (shape.width + vocab))]


def parameter_count(size: str, dataset: str = "digits", model: str = "cnn") -> int:
    return sum(layer.params for layer in layers(size, dataset, model))


def tp_pairs(size: str) -> list[tuple[str, str]]:
    """The classifier's linear layers that tensor parallelism splits, as (column-wise, row-wise) pairs: fc1 and
    the next, and so on. An odd last one (fc2 after an even number of hidden layers) is not in a pair."""
    linears = ["fc1", *(f"hidden{i}" for i in range(1, MODEL_SIZES[size][1])), "fc2"]
    return list(zip(linears[0::2], linears[1::2]))


def tp_degree(cfg: Config, world_size: int) -> int:
    """The ranks TP splits a layer over: train_tp.py's world / --dp, a pipeline's --tp (1 for DDP and FSDP)."""
    return world_size // cfg.dp if cfg.strategy == "tp" else cfg.tp


def check_tp(cfg: Config, world_size: int) -> None:
    """What train_tp.py's split needs of the model (`check_tp_degree`) and, with --sequence-parallel, of the
    ViT's tokens: every TP rank an equal share of them; a pipeline's --tp, the ViT. The runners check it before
    torchrun, the scripts after."""
    if cfg.strategy == "pippy" and cfg.model == "cnn" and cfg.tp > 1:
        raise ConfigError("--tp: a pipeline splits the ViT's blocks (--model vit); BabyCNN's TP is train_tp.py's")
    tp = tp_degree(cfg, world_size)
    if cfg.model == "gpt":
        return check_gpt_tp(cfg, tp)
    heads, mlp = (
        (cfg.heads or VIT_SIZES[cfg.model_size][3], VIT_SIZES[cfg.model_size][4]) if cfg.model == "vit" else (1, 1)
    )
    if cfg.strategy == "pippy" and (heads % tp or mlp % tp):
        fits = ", ".join(str(n) for n in (1, 2, 4, 8, 16) if heads % n == 0 and mlp % n == 0)
        raise ConfigError(f"--tp: {tp} TP ranks do not split {heads} heads (MLP width {mlp}); use --tp {fits}")
    if cfg.strategy == "tp":
        check_tp_degree(cfg.model_size, tp=tp, dp=cfg.dp, model=cfg.model, heads=cfg.heads)
    if cfg.sequence_parallel and cfg.model == "cnn":
        raise ConfigError("--sequence-parallel: a flag of the ViT (--model vit); BabyCNN has no tokens: drop it")
    if not cfg.sequence_parallel:
        return
    side = input_shape(cfg.model, cfg.model_size, cfg.dataset)[1]
    patch = cfg.patch_size or VIT_SIZES[cfg.model_size][0]
    if (tokens := (side // patch) ** 2) % tp:
        fits = [
            f"{p} ({(side // p) ** 2} tokens)" for p in range(2, side) if side % p == 0 and (side // p) ** 2 % tp == 0
        ]
        raise ConfigError(
            f"--sequence-parallel: the {tokens} tokens of {side} x {side} images in {patch} x {patch} patches do not "
            f"split over {tp} TP ranks; use a --patch-size whose tokens they divide ({', '.join(fits) or 'none'}), "
            f"or drop --sequence-parallel"
        )


def check_gpt_tp(cfg: Config, tp: int) -> None:
    """ConfigError unless `tp` ranks split BabyGPT's heads, key/value heads, SwiGLU width and vocabulary (each rank
    whole heads, its columns, its rows of the embedding and the output layer; the vocabulary is not padded), and
    with --sequence-parallel its tokens."""
    shape = GPT_SIZES[cfg.model_size]
    heads, kv_heads = gpt_heads(cfg.model_size, cfg.heads, cfg.kv_heads)
    vocab = gpt_vocab(cfg.model_size, cfg.dataset)
    parts = {"--heads": heads, "--kv-heads": kv_heads, "SwiGLU's width": shape.mlp, "the vocabulary": vocab}
    for what, n in parts.items():
        if n % tp:
            flag = what if what.startswith("--") else "--tp" if cfg.strategy == "pippy" else "--dp"
            fits = [d for d in (1, 2, 4, 8, 16, 32) if all(m % d == 0 for m in parts.values())]
            raise ConfigError(
                f"{flag}: {tp} TP ranks do not split {what} ({n}: each rank holds an equal share, nothing is padded); "
                f"use a TP degree of {', '.join(map(str, fits))}"
                + ("" if cfg.strategy == "pippy" else f" (NPROC= for run_tp.sh: --dp {cfg.dp} x the TP degree)")
            )
    if cfg.sequence_parallel and cfg.seq_len % tp:
        raise ConfigError(
            f"--sequence-parallel: the {cfg.seq_len} tokens of --seq-len do not split over {tp} TP ranks; use a "
            f"--seq-len that {tp} divides, or drop --sequence-parallel"
        )


def check_tp_degree(size: str, *, tp: int, dp: int, model: str = "cnn", heads: int = 0) -> None:
    """ConfigError unless `tp` ranks can split the classifier's width (fc1's outputs, the hidden layers'), or the
    ViT's heads and MLP width: each TP rank computes whole heads and its columns of every MLP."""
    if model == "vit":
        heads, mlp = heads or VIT_SIZES[size][3], VIT_SIZES[size][4]
        if heads % tp or mlp % tp:
            fits = ", ".join(str(n * dp) for n in (1, 2, 4, 8, 16) if heads % n == 0 and mlp % n == 0)
            raise ConfigError(
                f"--heads: {heads} heads (MLP width {mlp}) do not split over {tp} TP ranks (world size {tp * dp} / "
                f"--dp {dp}): each rank computes whole heads; use a number of processes whose TP share divides both "
                f"(e.g. {fits} processes, NPROC= for run_tp.sh)"
            )
        return
    width = MODEL_SIZES[size][0]
    if width % tp:
        fits = ", ".join(str(n * dp) for n in (1, 2, 4, 8) if width % n == 0)
        raise ConfigError(
            f"--model-size {size}: its classifier's width {width} does not split over {tp} TP ranks (world size "
            f"{tp * dp} / --dp {dp}); use a number of processes whose TP share divides {width} (e.g. {fits} "
            f"processes, NPROC= for run_tp.sh)"
        )


def tp_layer_params(size: str, tp: int, dataset: str = "digits", model: str = "cnn") -> dict[str, float]:
    """The parameters one TP rank of `tp` holds of each layer: a column-wise layer's weight and bias are split, a
    row-wise layer's weight (its bias, of its whole output, is not: every rank adds it once the partial outputs
    are summed); the other layers are whole."""
    split = tp_split_params(size, dataset, model)
    return {
        layer.name: layer.params - split.get(layer.name, 0) * (1 - 1 / tp) for layer in layers(size, dataset, model)
    }


def blocks(size: str, model: str = "cnn") -> list[list[str]]:
    """The layers of each of the model's blocks, FSDP's units (`blocks()` of the built model groups the same):
    BabyCNN's features, then its classifier, whole for baby, a layer at a time for the larger sizes (fc2 with the
    last); BabyViT's blocks, each alone (the embedding and the head stay with the root)."""
    if model == "vit":
        return [[f"block{i}"] for i in range(VIT_SIZES[size][2])]
    if model == "gpt":
        return [[f"block{i}"] for i in range(GPT_SIZES[size].depth)]
    names = [layer.name for layer in layers(size)]
    starts = [0, names.index("flatten"), *(i for i, name in enumerate(names) if name.startswith("hidden"))]
    return [names[a:b] for a, b in zip(starts, [*starts[1:], len(names)])]


def tp_fsdp_units(size: str, tp: int, dataset: str = "digits", model: str = "cnn") -> list[float]:
    """FSDP x TP's units, as train_tp.py makes them: the parameters a TP rank holds of each block (BabyCNN's root
    holds none of its own; the ViT's, the embedding and the head, is not a block)."""
    held = tp_layer_params(size, tp, dataset, model)
    return [sum(held[name] for name in block) for block in blocks(size, model)]


def tp_split_params(size: str, dataset: str, model: str = "cnn") -> dict[str, int]:
    """The parameters TP splits, by layer (the ViT's, by block: q, k, v and fc1 whole, proj's and fc2's weights;
    BabyGPT's, by block, and its embedding and output layer)."""
    if model == "vit":
        _, width, depth, _, mlp = VIT_SIZES[size]
        return {f"block{i}": 4 * width * width + 3 * width + 2 * width * mlp + mlp for i in range(depth)}
    if model == "gpt":  # a block's q, k, v, o and SwiGLU's three; the embedding and the output layer by vocabulary
        shape, vocab = GPT_SIZES[size], gpt_vocab(size, dataset)
        kv = shape.width // shape.heads * shape.kv_heads
        block = 2 * shape.width * shape.width + 2 * shape.width * kv + 3 * shape.width * shape.mlp
        return {
            "embed": vocab * shape.width,
            **{f"block{i}": block for i in range(shape.depth)},
            "head": vocab * shape.width,
        }
    by_name = {layer.name: layer for layer in layers(size, dataset)}
    split = {}
    for col, row in tp_pairs(size):
        split[col] = by_name[col].params
        split[row] = by_name[row].params - by_name[row].outputs  # the weight; the bias has one value per output
    return split


# Where a stage may start. `flatten` always opens a stage: its output is a view, and the zero-bubble schedules
# reject a stage output that is a view (torch 2.14.1: "Failed to run stage backward input"); so fc1 never does.
# `dropout` never ends one, as a precaution: in eval mode it returns its input itself (torch 2.14.1 trains and
# evaluates either way).
_NEVER_STARTS = ("fc1", "dropout", "relu3")
# BabyCNN's own cut, chosen to read easily (conv2 holds ~88% of its FLOPs, so no cut balances it): the stage
# starts for 1..8 stages. The other sizes are cut into stages of equal cost (balanced_starts).
BABY_STAGE_STARTS: dict[int, tuple[str, ...]] = {
    1: ("conv1",),
    2: ("conv1", "flatten"),
    3: ("conv1", "conv2", "flatten"),
    4: ("conv1", "conv2", "flatten", "fc2"),
    5: ("conv1", "conv2", "norm", "flatten", "fc2"),
    6: ("conv1", "conv2", "norm", "pool", "flatten", "fc2"),
    7: ("conv1", "relu1", "conv2", "norm", "pool", "flatten", "fc2"),
    8: ("conv1", "relu1", "conv2", "norm", "relu2", "pool", "flatten", "fc2"),
}


def _groups(size: str, dataset: str, model: str = "cnn") -> list[list[Layer]]:
    """The layers in runs that a cut may not split. BabyCNN: a cut only ever falls before `flatten` or a layer with
    parameters (the others go with the layer before them), and never before the layers in _NEVER_STARTS. BabyViT:
    between blocks, the embedding with the first, the head with the last."""
    groups: list[list[Layer]] = []
    for layer in layers(size, dataset, model):
        if model in ("vit", "gpt"):
            opens = layer.name.startswith("block") and layer.name != "block0"
        else:
            opens = layer.name == "flatten" or (layer.params > 0 and layer.name not in _NEVER_STARTS)
        if opens or not groups:
            groups.append([layer])
        else:
            groups[-1].append(layer)
    return groups


def max_stages(size: str, model: str = "cnn") -> int:
    """How many stages the model at `size` can be cut into (BabyViT: its blocks)."""
    if model in ("vit", "gpt"):
        return VIT_SIZES[size][2] if model == "vit" else GPT_SIZES[size].depth
    return max(BABY_STAGE_STARTS) if size == "baby" else len(_groups(size, "digits"))


def stage_starts(size: str, n_stages: int, dataset: str = "digits", model: str = "cnn") -> tuple[str, ...]:
    """The first layer of each of `n_stages` stages. BabyCNN baby: its table; the others: the cut that makes the
    costliest stage cheapest, with a layer's cost its forward and backward FLOPs (backward ~ twice forward)."""
    if not 1 <= n_stages <= max_stages(size, model):
        raise ValueError(f"{model} {size} can be cut into 1 to {max_stages(size, model)} stages, not {n_stages}")
    if size == "baby" and model == "cnn":
        return BABY_STAGE_STARTS[n_stages]
    groups = _groups(size, dataset, model)
    costs = [3 * sum(layer.flops for layer in group) for group in groups]
    # best[k][i]: the smallest possible cost of the costliest stage when groups[:i] form k stages
    inf = float("inf")
    best = [[inf] * (len(groups) + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (len(groups) + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        for i in range(k, len(groups) + 1):
            for j in range(k - 1, i):  # the k-th stage is groups[j:i]
                cost = max(best[k - 1][j], sum(costs[j:i]))
                if cost < best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    starts, i = [], len(groups)
    for k in range(n_stages, 0, -1):
        i = cut[k][i]
        starts.append(groups[i][0].name)
    return tuple(reversed(starts))
