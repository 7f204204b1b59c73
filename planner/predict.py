"""What the scripts' strategies should cost, predicted from the model and the mesh alone: what each rank sends
and receives per optimizer step, by collective (`traffic`), and the textbook's training state per rank
(`state_bytes_theory`, `tp_state_bytes_theory`). A run counts the same elements from the collectives its profiler
saw (--profile-steps: run.json "profile", per rank) and measures its state (run.json "memory"); the tests set
these predictions beside them. docs/communication.md explains the numbers.

Bytes are those of the ring algorithms that nccl-tests' bus bandwidth assumes: over n ranks an all-reduce of S
bytes sends and receives 2 (n - 1) / n S per rank, an all-gather (S: what is gathered) and a reduce-scatter (S:
what is reduced) (n - 1) / n S; a point-to-point send moves S.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from common.config import Config
from common.gpt_sizes import GPT_SIZES
from common.model import build_model
from common.model_sizes import (
    gpt_layers,
    gpt_vocab,
    input_shape,
    layers,
    parameter_count,
    tp_degree,
    tp_layer_params,
    tp_pairs,
    tp_split_params,
)
from common.pipeline import split_model
from common.pipeline_layout import PipelineLayout
from common.vit_sizes import VIT_SIZES

Traffic = dict[str, dict[str, float]]  # collective -> {"elements", "bytes", "bytes_sent", "bytes_received"}

RING_SHARE = {  # what share of the collective's size each of n ranks sends (and receives), by the ring
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
}


def add(traffic: Traffic, kind: str, *, elements: int, itemsize: int, ranks: int = 2, times: int = 1) -> Traffic:
    """Count `times` collectives of `kind` (all_reduce, all_gather, reduce_scatter over `ranks`; send; recv) on
    tensors of `elements` elements of `itemsize` bytes into `traffic`; returns it. "bytes" is their size as
    nccl-tests counts it, "bytes_sent" and "bytes_received" what this rank moves."""
    if kind in RING_SHARE and ranks == 1:
        return traffic  # a collective over one rank: nothing runs (FSDP and DTensor skip it)
    entry = traffic.setdefault(kind, {"elements": 0, "bytes": 0, "bytes_sent": 0, "bytes_received": 0})
    size = elements * itemsize * times
    entry["elements"] += elements * times
    entry["bytes"] += size
    if kind in RING_SHARE:
        entry["bytes_sent"] += RING_SHARE[kind](ranks) * size
        entry["bytes_received"] += RING_SHARE[kind](ranks) * size
    else:
        entry["bytes_sent" if kind == "send" else "bytes_received"] += size
    return traffic


def padded_shard(shape: tuple[int, ...], shards: int) -> int:
    """Elements of one FSDP2 shard of a parameter of `shape`: dim 0 cut in `shards` equal rows, the last ones
    padded (so every rank's shard, and the all-gather's buffer, has the same size)."""
    rest = 1
    for size in shape[1:]:
        rest *= size
    return -(-shape[0] // shards) * rest if shape else 1


def total_bytes(traffic: Traffic) -> float:
    return sum(entry["bytes_sent"] for entry in traffic.values())


def _model(cfg: Config) -> nn.Module:
    """The run's model on the meta device: shapes, no memory (a 7 B model costs nothing)."""
    if cfg.model == "gpt":
        shape = {"vocab_size": gpt_vocab(cfg.model_size, cfg.dataset), "seq_len": cfg.seq_len}
    else:
        channels, side, classes = input_shape(cfg.model, cfg.model_size, cfg.dataset)
        shape = {"in_channels": channels, "image_size": side, "num_classes": classes}
    with torch.device("meta"):
        return build_model(**cfg.model_kwargs(), **shape)


def _example(cfg: Config) -> torch.Tensor:
    """One sample on the meta device: an image, or BabyGPT's sequence of tokens."""
    if cfg.model == "gpt":
        return torch.zeros(1, cfg.seq_len, dtype=torch.int64, device="meta")
    channels, side, _ = input_shape(cfg.model, cfg.model_size, cfg.dataset)
    return torch.empty(1, channels, side, side, device="meta")


def _params(unit: nn.Module | list[nn.Module]) -> list[nn.Parameter]:
    """A unit's parameters: a block's, or those of a list of layers sharded together."""
    return list(unit.parameters()) if isinstance(unit, nn.Module) else [p for layer in unit for p in layer.parameters()]


def _itemsize(cfg: Config) -> int:
    """Bytes of one activation element: autocast's bf16 or fp16, else fp32."""
    return {"bf16": 2, "fp16": 2}.get(cfg.precision, 4)


def traffic(cfg: Config, world_size: int, rank: int) -> Traffic:
    """What rank `rank` of `world_size` moves per optimizer step, training `cfg` (its strategy, mesh and model)."""
    model = _model(cfg)
    if cfg.strategy == "ddp":  # every gradient all-reduced once, bucket by bucket, on the last accumulation step
        found: Traffic = {}
        for p in model.parameters():
            add(found, "all_reduce", elements=p.numel(), itemsize=p.element_size(), ranks=world_size)
        return found
    if cfg.strategy == "fsdp":
        return _fsdp_traffic(model, cfg, world_size)
    if cfg.strategy == "tp":
        return _tp_traffic(model, cfg, world_size)
    return _pipeline_traffic(model, cfg, world_size, rank)


def _fsdp_traffic(model: nn.Module, cfg: Config, world_size: int) -> Traffic:
    """FSDP's units as train_fsdp.py makes them: each unit's parameters all-gathered before its forward (each
    accumulation step) and, if it was resharded after forward, again before its backward; its gradients
    reduce-scattered once, and with hybrid the shard all-reduced over the replicas. Shards are padded to equal
    rows (`padded_shard`)."""
    replicas = {"full": 1, "grad-op": 1, "hybrid": 2, "none": world_size}[cfg.sharding]
    shard = world_size // replicas
    blocks = model.blocks() if cfg.shard_units == "blocks" else []
    in_blocks = {id(p) for unit in blocks for p in _params(unit)}
    units = [_params(unit) for unit in blocks]
    units.append([p for p in model.parameters() if id(p) not in in_blocks])  # the root: what no block holds
    gather_itemsize = 2 if cfg.precision in ("bf16", "fp16") else 4  # (reduced in fp32 either way)
    found: Traffic = {}
    for i, params in enumerate(units):
        elements = shard * sum(padded_shard(tuple(p.shape), shard) for p in params)
        if not elements:
            continue
        # resharded after forward: every unit but the last block and the root, unless grad-op or none keep them
        regathered = cfg.sharding in ("full", "hybrid") and i < len(units) - 2
        gathers = cfg.grad_accum_steps * (2 if regathered else 1)
        add(found, "all_gather", elements=elements, itemsize=gather_itemsize, ranks=shard, times=gathers)
        add(found, "reduce_scatter", elements=elements, itemsize=4, ranks=shard)
        if replicas > 1:
            add(found, "all_reduce", elements=elements // shard, itemsize=4, ranks=replicas)
    return found


def _tp_traffic(model: nn.Module, cfg: Config, world_size: int) -> Traffic:
    """Per accumulation step, what the model's plan moves over "tp": a row-wise layer's output summed (an
    all-reduce, or with sequence parallel a reduce-scatter by tokens and in backward an all-gather of its gradient);
    in backward a column-wise layer's input gradient summed (q, k and v each their own), unless its module's input
    was gathered by tokens, whose gradient is then reduce-scattered once; a gather before the head, and the cut after
    the embedding in backward, an all-gather; per step, the sequence-parallel LayerNorms' gradients all-reduced.
    With --dp, FSDP over "dp" of what TP leaves each rank, a unit per block of the model: each gathered before its
    forward and again before its backward, its gradients reduce-scattered once; the root's (what no block holds)
    gathered once."""
    tp, chunk, steps = world_size // cfg.dp, cfg.chunk_size(world_size), cfg.grad_accum_steps
    found: Traffic = {}
    plan = model.tp_plan(cfg.sequence_parallel)
    split_dim = _tp_plan_traffic(found, model, cfg, plan, tp=tp, samples=chunk, times=steps)
    if cfg.model == "gpt":  # the loss on logits split by vocabulary (loss_parallel): per token, the largest logit,
        # the sum of the exponentials and the target's logit, each summed over "tp" (fp32), forward only
        add(found, "all_reduce", elements=chunk * cfg.seq_len, itemsize=4, ranks=tp, times=3 * steps)
    if cfg.dp > 1:
        shard = lambda p: _tp_shard(p, split_dim, tp, cfg.dp)  # noqa: E731

        in_blocks = {id(p) for unit in model.blocks() for p in _params(unit)}
        root = [p for p in model.parameters() if id(p) not in in_blocks]  # (the ViT's embedding and head)
        for params, gathers in [*((_params(unit), 2) for unit in model.blocks()), (root, 1)]:
            if elements := cfg.dp * sum(shard(p) for p in params):
                add(found, "all_gather", elements=elements, itemsize=4, ranks=cfg.dp, times=gathers * steps)
                add(found, "reduce_scatter", elements=elements, itemsize=4, ranks=cfg.dp)
    return found


def _tp_shard(p: nn.Parameter, split_dim: dict[int, int], tp: int, dp: int) -> int:
    """Elements of this rank's TP part of `p` (its `split_dim` cut in `tp`), sharded again over `dp` replicas."""
    shape = list(p.shape)
    if id(p) in split_dim:
        shape[split_dim[id(p)]] //= tp
    return padded_shard(tuple(shape), dp)


def _tp_plan_traffic(
    found: Traffic, model: nn.Module, cfg: Config, plan: dict[str, Any], *, tp: int, samples: int, times: int
) -> dict[int, int]:
    """Count into `found` what `plan`'s layers move over "tp" (`_tp_traffic` says what) for `times` passes of
    `samples` samples; returns {id(parameter): the dim TP splits}."""
    item = _itemsize(cfg)
    sizes = _per_sample(model, cfg, plan)

    def move(kind: str, name: str, which: int) -> None:  # the input (0) or output (1) of `name`, per pass
        size = item
        if cfg.model == "gpt" and (which == 0 or isinstance(model.get_submodule(name), nn.Embedding)):
            size = 4  # under autocast BabyGPT's RMSNorms and embedding hand on fp32: only a linear's output is not
        add(found, kind, elements=samples * sizes[name][which], itemsize=size, ranks=tp, times=times)

    split_dim = {}  # parameter -> the dim TP splits: a column-wise layer's rows (and bias), a row-wise one's columns
    for name, style in plan.items():
        kind, module = type(style).__name__, model.get_submodule(name)
        if kind == "RowwiseParallel":
            by_tokens = style.output_layouts[0].is_shard()
            for collective in ("reduce_scatter", "all_gather") if by_tokens else ("all_reduce",):
                move(collective, name, 1)
            split_dim[id(module.weight)] = 0 if isinstance(module, nn.Embedding) else 1  # (an embedding's rows)
        elif kind == "ColwiseParallel":
            gathered = type(plan.get(name.rsplit(".", 1)[0])).__name__ == "PrepareModuleInput"
            if style.input_layouts[0].is_shard():  # its input cut by tokens (BabyGPT's head under sequence
                # parallel): gathered for it, its gradient reduce-scattered back
                move("all_gather", name, 0)
                move("reduce_scatter", name, 0)
            elif not gathered:
                move("all_reduce", name, 0)
            if style.output_layouts[0].is_replicate():  # its output gathered whole (BabyGPT's logits in a pipeline)
                move("all_gather", name, 1)
            split_dim |= {id(module.weight): 0, id(module.bias): 0}
        elif kind == "PrepareModuleInput":  # a gather of the tokens; its gradient reduce-scattered unless the
            # module computes whole on every rank (the head); or the cut after the embedding, gathered in backward
            move("all_gather", name, 0)
            if style.desired_input_layouts[0].is_replicate() and not style.use_local_output:
                move("reduce_scatter", name, 0)
        elif kind == "SequenceParallel":
            for p in module.parameters():
                add(found, "all_reduce", elements=p.numel(), itemsize=4, ranks=tp)
    return split_dim


def _per_sample(model: nn.Module, cfg: Config, names: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """{layer name: (its input's elements, its output's elements)} for one sample, from a forward on meta tensors:
    a linear's features, times the tokens in a transformer."""
    found: dict[str, tuple[int, int]] = {}
    hooks = [
        model.get_submodule(name).register_forward_hook(
            lambda _, inputs, out, name=name: found.__setitem__(name, (inputs[0].numel(), out.numel()))  # (None)
        )
        for name in names
    ]
    model(_example(cfg))
    for hook in hooks:
        hook.remove()
    return found


def _pipeline_traffic(model: nn.Module, cfg: Config, world_size: int, rank: int) -> Traffic:
    """For every micro-batch, each activation that crosses to a stage on another rank and, in backward, its
    gradient coming back; with --tp, what the stage's part of the model's TP plan moves over "tp" per micro-batch;
    with --dp, each stage's FSDP2 all-gather and reduce-scatter over the replicas (once per schedule step). The mesh
    is (dp, pp, tp), TP innermost."""
    layout = PipelineLayout.of(cfg, world_size)
    pp_rank = rank // cfg.tp % layout.pp_size
    pieces = split_model(model, layout.stage_starts)
    micro_batch = cfg.chunk_size(world_size) // cfg.n_microbatches
    times = cfg.n_microbatches * cfg.grad_accum_steps
    outputs, x = [], _example(cfg)
    for piece in pieces:
        x = piece(x)
        outputs.append(micro_batch * x[0].numel())
    found: Traffic = {}
    item = 4 if cfg.model == "gpt" else _itemsize(cfg)  # (BabyGPT's residual stream stays fp32 under autocast)
    plan = {}
    if cfg.tp > 1:  # (BabyGPT's last stage gathers its logits whole: train_pippy.py's plan)
        plan = model.tp_plan(loss_parallel=False) if cfg.model == "gpt" else model.tp_plan()
    for s in layout.stages_of(pp_rank):
        if s + 1 < layout.n_stages and layout.owner(s + 1) != pp_rank:  # forward out, its gradient back in
            add(found, "send", elements=outputs[s], itemsize=item, times=times)
            add(found, "recv", elements=outputs[s], itemsize=item, times=times)
        if s > 0 and layout.owner(s - 1) != pp_rank:  # forward in, its gradient back out
            add(found, "recv", elements=outputs[s - 1], itemsize=item, times=times)
            add(found, "send", elements=outputs[s - 1], itemsize=item, times=times)
        split_dim: dict[int, int] = {}
        if plan:  # as apply_pipeline: the entries of the layers this stage holds
            mine = {name: style for name, style in plan.items() if name.split(".")[0] in pieces[s]._modules}
            split_dim = _tp_plan_traffic(found, model, cfg, mine, tp=cfg.tp, samples=micro_batch, times=times)

        elements = layout.dp * sum(_tp_shard(p, split_dim, cfg.tp, layout.dp) for p in pieces[s].parameters())
        if layout.dp > 1 and elements:
            add(found, "all_gather", elements=elements, itemsize=4, ranks=layout.dp, times=cfg.grad_accum_steps)
            add(found, "reduce_scatter", elements=elements, itemsize=4, ranks=layout.dp, times=cfg.grad_accum_steps)
    return found


def state_bytes_theory(n_params: int, *, shards: int, optimizer: str) -> dict[str, Any]:
    """The textbook's training state per rank: per parameter 4 + 4 bytes (fp32 weight, gradient) and the
    optimizer's state (AdamW 8, SGD 4), divided by the ranks that share it (what it leaves out: docs/fsdp.md)."""
    per_param = {"param_bytes": 4, "grad_bytes": 4, "optim_bytes": 8 if optimizer == "adamw" else 4}
    return {"parameters": n_params, "shards": shards, **{k: v * n_params / shards for k, v in per_param.items()}}


def tp_state_bytes_theory(
    size: str, *, tp: int, dp: int, optimizer: str, dataset: str = "digits", model: str = "cnn"
) -> dict[str, Any]:
    """The training state per rank under TP (x FSDP over `dp` replicas, or over the ranks of a pipeline and its
    replicas): what tp_layer_params gives a TP rank, divided by `dp`."""
    held = tp_layer_params(size, tp, dataset, model)
    split = sum(tp_split_params(size, dataset, model).values())
    per_param = state_bytes_theory(1, shards=1, optimizer=optimizer)
    return {
        "parameters": parameter_count(size, dataset, model),
        "split_parameters": split,
        "tp": tp,
        "dp": dp,
        **{k: per_param[k] * sum(held.values()) / dp for k in ("param_bytes", "grad_bytes", "optim_bytes")},
        "split_param_bytes": 4 * split / tp / dp,  # of param_bytes: the split parameters' (DDP's: 4 * split)
    }


def layer_flops(cfg: Config, *, kernels: bool = True) -> dict[str, tuple[int, int]]:
    """{layer: (forward, backward) FLOPs per sample} of the model, from its sizes (common/model_sizes.py): backward
    twice forward (the gradients of the input and of the weights) but for the first layer with FLOPs, whose input,
    the images, needs no gradient; and, as the `kernels` run it, for attention, whose kernels recompute the scores
    in backward (five matmuls of the tokens by the tokens to forward's two: torch.utils.flop_counter's count).
    BabyGPT's (per sequence of --seq-len): its scores counted as a full square, as MFU's numerator counts them
    (PaLM's 6 N + 12 L T d per token); its kernels skip the causal mask's upper half (`causal_attention`)."""
    if cfg.model == "gpt":
        return _gpt_layer_flops(cfg, kernels=kernels)
    attention = 0
    if cfg.model == "vit" and kernels:
        patch, width, *_ = VIT_SIZES[cfg.model_size]
        tokens = (input_shape("vit", cfg.model_size, cfg.dataset)[1] // patch) ** 2
        attention = 4 * tokens * tokens * width  # forward: q k^T and (softmax) v, 2 FLOPs a multiply-add
    found, first = {}, True
    for layer in layers(cfg.model_size, cfg.dataset, cfg.model):
        extra = attention // 2 if layer.name.startswith("block") else 0
        found[layer.name] = (layer.flops, layer.flops * (1 if first else 2) + extra)
        first = first and not layer.flops
    return found


def gpt_attention_flops(cfg: Config) -> int:
    """A BabyGPT block's forward FLOPs of the scores and their use per sequence, counted as a full square: q k^T
    and the scores times v, 2 x T x T x width each."""
    return 4 * cfg.seq_len * cfg.seq_len * GPT_SIZES[cfg.model_size].width


def _gpt_layer_flops(cfg: Config, *, kernels: bool) -> dict[str, tuple[int, int]]:
    """BabyGPT's layers (common/model_sizes.gpt_layers at --seq-len): backward twice forward everywhere (the
    embedding's output needs its gradient, for the embedding's); with `kernels`, attention as the causal kernels
    run it (planner/count.py counts it so): half the square forward, and backward's five matmuls of it to forward's
    two, again half."""
    attention = gpt_attention_flops(cfg) if kernels else 0
    found = {}
    for layer in gpt_layers(cfg.model_size, cfg.dataset, cfg.seq_len):
        if layer.name.startswith("block") and attention:
            matmuls = layer.flops - attention
            found[layer.name] = (matmuls + attention // 2, 2 * matmuls + 5 * attention // 4)
        else:
            found[layer.name] = (layer.flops, 2 * layer.flops)
    return found


def analytic_flops(cfg: Config, world_size: int, rank: int) -> dict[str, float]:
    """{"forward", "backward"}: the FLOPs rank `rank` of `world_size` does per optimizer step by the model's sizes:
    its samples through the layers it holds (a pipeline rank its stages', a TP rank 1/tp of each layer TP splits);
    "recomputed": the forwards activation checkpointing runs again in backward (the step's FLOPs, not the
    model's: backward's are backward + recomputed)."""
    per_layer = layer_flops(cfg)
    samples = cfg.chunk_size(world_size) * cfg.grad_accum_steps
    share = {name: 1.0 for name in per_layer}
    tp = tp_degree(cfg, world_size)
    if tp > 1:  # the layers TP splits: the ViT's blocks (heads, MLP columns), BabyCNN's classifier pairs
        split = [name for name in per_layer if name.startswith("block")] if cfg.model in ("vit", "gpt") else []
        split += ["head"] if cfg.model == "gpt" else []  # (its output layer by vocabulary)
        split += [name for pair in (tp_pairs(cfg.model_size) if cfg.model == "cnn" else []) for name in pair]
        share |= {name: 1 / tp for name in split}
    if cfg.strategy == "pippy":
        layout = PipelineLayout.of(cfg, world_size)
        names = list(per_layer)
        bounds = [names.index(s) for s in layout.stage_starts] + [len(names)]
        mine = {n for s in layout.stages_of(rank // cfg.tp % layout.pp_size) for n in names[bounds[s] : bounds[s + 1]]}
        share = {name: value if name in mine else 0.0 for name, value in share.items()}
    found = {
        phase: samples * sum(share[name] * flops[i] for name, flops in per_layer.items())
        for i, phase in enumerate(("forward", "backward"))
    }
    found["recomputed"] = samples * _recomputed(cfg) if cfg.strategy == "fsdp" and cfg.activation_checkpointing else 0
    return found


def _recomputed(cfg: Config) -> int:
    """The forward FLOPs per sample activation checkpointing runs again in backward, as train_fsdp.py checkpoints:
    each of the ViT's blocks, BabyCNN (whose blocks are lists of layers) whole. Recomputation stops once backward
    has what it needs: the last matmul of each checkpointed span (the ViT's fc2, BabyCNN's fc2) needs only its
    input, so it is not run again."""
    per_layer = layer_flops(cfg)
    if cfg.model == "cnn":
        return sum(f for name, (f, _) in per_layer.items() if name != "fc2")
    if cfg.model == "gpt":  # each block but its last matmul, SwiGLU's down
        shape = GPT_SIZES[cfg.model_size]
        down = 2 * cfg.seq_len * shape.mlp * shape.width
        return sum(f - down for name, (f, _) in per_layer.items() if name.startswith("block"))
    patch, width, _, _, mlp = VIT_SIZES[cfg.model_size]
    tokens = (input_shape("vit", cfg.model_size, cfg.dataset)[1] // patch) ** 2
    return sum(f - 2 * tokens * mlp * width for name, (f, _) in per_layer.items() if name.startswith("block"))


def model_flops_per_step(cfg: Config) -> float:
    """The model's training FLOPs of one optimizer step over the global batch (MFU's numerator): every layer's
    forward and backward (twice forward; attention's scores not recomputed), whatever the strategy."""
    return cfg.batch_size * sum(f + b for f, b in layer_flops(cfg, kernels=False).values())


def ring_traffic(cfg: Config, world_size: int) -> dict[str, dict[str, int]]:
    """What context parallelism's ring (common/ring_attention.py) sends per step on each rank, by the model's sizes:
    {phase: {"kv_sends", "kv_bytes", "dkv_sends", "dkv_bytes"}}, each send's bytes. A key/value message is
    [2, B, kv heads, seq_len / cp, head width] in the dtype the layers compute in (FSDP's param_dtype; unrepeated
    grouped heads); per attention layer and micro-batch forward sends it cp - 1 times, backward cp - 1 times again
    and the fp32 gradient accumulator of its shape cp times (its last send brings it home); with activation
    checkpointing backward runs forward's again first."""
    from common.gpt_sizes import gpt_heads

    cp = world_size // cfg.dp
    shape = GPT_SIZES[cfg.model_size]
    heads, kv_heads = gpt_heads(cfg.model_size, cfg.heads, cfg.kv_heads)
    elements = 2 * cfg.chunk_size(world_size) * kv_heads * (cfg.seq_len // cp) * (shape.width // heads)
    layers = shape.depth * cfg.grad_accum_steps  # an attention a block, each micro-batch
    again = 2 if cfg.activation_checkpointing else 1
    kv = {"kv_bytes": elements * _itemsize(cfg), "dkv_bytes": elements * 4}
    if cp == 1:
        return {phase: {**kv, "kv_sends": 0, "dkv_sends": 0} for phase in ("forward", "backward")}
    return {
        "forward": {**kv, "kv_sends": layers * (cp - 1), "dkv_sends": 0},
        "backward": {**kv, "kv_sends": layers * (cp - 1) * again, "dkv_sends": layers * cp},
    }
