"""The memory wall, before torchrun starts: a run whose processes cannot fit in the machine's memory (or a GPU's)
costs one line, with what would fit, instead of the kernel's OOM killer and a screenful of torchrun noise.

What a process needs is the runtime (torch, the data set, gloo: MIB_PER_CPU_PROCESS on a CPU) plus the most
tensor bytes its rank holds during a step, in closed form here (`planned_peak_bytes`: a test holds it within
25 % of `python -m planner`, which measures the scripts' own wrap on fake tensors). No torch here.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import replace

from common.config import Config
from common.errors import ConfigError
from common.gpt_sizes import GPT_SIZES
from common.model_sizes import (
    Layer,
    blocks,
    gpt_layers,
    gpt_vocab,
    layers,
    tp_degree,
    tp_fsdp_units,
    tp_layer_params,
)
from runner.layout import would_start

# Memory one CPU training process of this suite takes (torch, the built-in data set, BabyCNN, gloo), rounded up
# from the peak Pss measured per worker (docs/checkpoints.md, "Too many processes", says how). Larger data sets
# take more: a refusal is always right, a launch let through may still be tight.
MIB_PER_CPU_PROCESS = 700
CUDA_CONTEXT_MIB = 1024  # a GPU process's CUDA context and NCCL buffers, outside torch's tensors (about)


def planned_peak_bytes(cfg: Config, world_size: int) -> int:
    """The most tensor bytes one rank of this run holds during a step, for the rank that holds the most.
    State: 16 bytes per parameter with AdamW in fp32 (12 with SGD), divided by the ranks sharing it; FSDP adds
    its largest unit gathered whole (parameters and gradients; grad-op keeps every unit's parameters gathered;
    FSDP x TP gathers a TP rank's part of the model);
    a pipeline rank holds its stages, with as many micro-batches in flight as the ranks after it; and every rank
    the activations of its share of the batch (CP: of 1/cp of its replica's sequences, its parameters FSDP's;
    EP: every parameter's state over every rank, as FSDP's, with a block's dense part and its experts gathered)."""
    model = model_layers(cfg)
    names = [layer.name for layer in model]
    params = sum(layer.params for layer in model)
    state = 16 if cfg.optimizer == "adamw" else 12
    tp = tp_degree(cfg, world_size)
    kept_by_layer = {layer.name: layer.outputs for layer in model}  # values per sample a layer keeps for backward
    if cfg.model == "vit" and tp > 1:  # a block's heads, q, k, v and MLP split; norms and residuals (SP: 1/tp) not
        from common.vit_sizes import VIT_SIZES

        _, width, depth, heads, mlp = VIT_SIZES[cfg.model_size]
        tokens = model[0].outputs // width  # (the embedding's output: tokens x width)
        whole = tokens * (2 * width + 2 * width / (tp if cfg.sequence_parallel else 1))
        split = tokens * (3 * width + 2 * mlp) + heads * tokens * tokens
        kept_by_layer |= {f"block{i}": int(whole + split / tp) for i in range(depth)}
    if cfg.model == "gpt" and tp > 1:  # the same for BabyGPT's blocks (gpt_layers' count), and its logits by vocabulary
        from common.gpt_sizes import GPT_SIZES

        shape, t = GPT_SIZES[cfg.model_size], cfg.seq_len
        kv = shape.width // shape.heads * shape.kv_heads
        whole = t * (2 * shape.width + 2 * shape.width / (tp if cfg.sequence_parallel else 1))
        split = t * (2 * shape.width + 2 * kv + 3 * shape.mlp) + shape.heads * t * t
        kept_by_layer |= {f"block{i}": int(whole + split / tp) for i in range(shape.depth)}
        kept_by_layer["head"] = int(kept_by_layer["head"] - t * gpt_vocab(cfg.model_size, cfg.dataset) * (1 - 1 / tp))
    per_sample = 4 * sum(kept_by_layer.values())  # fp32 activations kept for backward
    if cfg.model in ("vit", "gpt") and cfg.strategy in ("fsdp", "cp", "ep") and cfg.activation_checkpointing:
        # each block keeps its input (tokens x width, the embedding's output); one block's activations at a time
        kept = sum(model[0].outputs for layer in model if layer.name.startswith("block"))
        per_sample = 4 * (kept + max(layer.outputs for layer in model))
    if cfg.strategy == "pippy":
        from common.pipeline_layout import PipelineLayout

        layout = PipelineLayout.of(cfg, world_size)
        params_held = tp_layer_params(cfg.model_size, cfg.tp, cfg.dataset, cfg.model)
        bounds = [names.index(start) for start in layout.stage_starts] + [len(names)]
        micro_batch = cfg.chunk_size(world_size) // cfg.n_microbatches
        most = 0
        for rank in range(layout.pp_size):
            held = 0
            for stage in layout.stages_of(rank):
                part = model[bounds[stage] : bounds[stage + 1]]
                stage_params = int(sum(params_held[layer.name] for layer in part))  # (--tp: a TP rank's part)
                in_flight = min(layout.pp_size - rank, cfg.n_microbatches) * micro_batch
                held += state * stage_params // cfg.dp + (8 * stage_params if cfg.dp > 1 else 0)
                held += in_flight * 4 * sum(kept_by_layer[layer.name] for layer in part)
            most = max(most, held)
        return most
    batch = cfg.chunk_size(world_size) * per_sample
    if cfg.strategy == "cp":  # FSDP's share over every rank (below), and each rank 1/cp of every sequence's activations
        batch //= world_size // cfg.dp
    if cfg.strategy == "tp":  # a TP rank holds 1/tp of the split parameters and all others; --dp shards that
        units = tp_fsdp_units(cfg.model_size, world_size // cfg.dp, cfg.dataset, cfg.model)
        local = int(sum(units))
        if cfg.dp == 1:
            return state * local + batch
        return state * local // cfg.dp + 8 * int(max(units)) + batch  # the largest unit gathered, its gradients
    if cfg.strategy == "ddp" or cfg.sharding == "none":
        return state * params + batch
    if cfg.strategy == "ep":
        # An estimate kept simple (not the planner's): every parameter's state over every rank (train_ep.py: the dense
        # parts FSDP's over the world, each layer's routed experts split over --ep and FSDP's over the world / ep
        # groups), a block's dense part gathered (its parameters, then its gradients) and, with more than one group,
        # its E / ep experts gathered over the groups; the activations as FSDP's, the tokens a rank's experts receive
        # counted as the ones it sends (even routing: uneven routing makes a busy rank hold more)
        ep = cfg.ep or world_size
        unit = max(layer.params for layer in model if layer.name.startswith("block")) - expert_params(cfg)
        experts = expert_params(cfg) // ep if world_size > ep else 0  # one group: the rank's experts are whole
        return state * params // world_size + 8 * (unit + experts) + batch
    shards = world_size // 2 if cfg.sharding == "hybrid" else world_size
    by_layer = {layer.name: layer.params for layer in model}
    block = max(sum(by_layer[name] for name in names) for names in blocks(cfg.model_size, cfg.model))
    unit = params if cfg.shard_units == "model" else block
    gathered = 4 * params if cfg.sharding == "grad-op" else 4 * unit
    return state * params // shards + gathered + 4 * unit + batch


def model_layers(cfg: Config) -> list[Layer]:
    """The model's layers as model_sizes counts them, BabyGPT's at the run's --seq-len (with --experts on a dense
    size, its blocks' MLP replaced by the mixture: `moe_block`)."""
    if cfg.model == "gpt":
        model = gpt_layers(cfg.model_size, cfg.dataset, cfg.seq_len)
        if cfg.experts and not getattr(GPT_SIZES[cfg.model_size], "experts", 0):  # (a size with experts counts its own)
            params, kept = moe_block(cfg)
            model = [
                replace(layer, params=layer.params + params, outputs=layer.outputs + kept)
                if layer.name.startswith("block")
                else layer
                for layer in model
            ]
        return model
    return layers(cfg.model_size, cfg.dataset, cfg.model)


def expert_params(cfg: Config) -> int:
    """One block's routed experts (--experts of them, each a SwiGLU as wide as the size's MLP): what EP divides."""
    shape = GPT_SIZES[cfg.model_size]
    return cfg.experts * 3 * shape.width * (getattr(shape, "expert_mlp", 0) or shape.mlp) if cfg.experts else 0


def moe_block(cfg: Config) -> tuple[int, int]:
    """What --experts adds to a dense block of BabyGPT (common/moe.py): parameters (the router, the experts and a
    --shared-expert in place of the MLP) and values kept per sequence (the router's scores, and each token's
    top-k experts' SwiGLU, plus the shared one's, in place of the MLP's)."""
    shape, t = GPT_SIZES[cfg.model_size], cfg.seq_len
    dense = 3 * shape.width * shape.mlp
    params = shape.width * cfg.experts + expert_params(cfg) + cfg.shared_expert * dense - dense
    kept = t * (cfg.experts + (cfg.top_k + cfg.shared_expert - 1) * 3 * shape.mlp)
    return params, kept


MB_PER_MIB = 2**20 / 1e6  # the runners measure in MiB and print MB and GB (10^6, 10^9 bytes), as the planner


def gb(mib: float) -> str:
    """A size measured in MiB, as the planner and the docs write it: 9.2 GB."""
    return f"{mib * MB_PER_MIB / 1000:.1f} GB"


def available_mib() -> int | None:
    """MemAvailable from /proc/meminfo (what can be allocated without swapping), or None off Linux."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


def gpu_mib() -> int | None:
    """The smallest GPU's memory, from nvidia-smi (no torch here), or None."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        return min(int(line) for line in out.split())
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def check_memory(cfg: Config, *, nproc: int, world_size: int, on_cpu: bool) -> None:
    """ConfigError when the run does not fit: on a CPU, `nproc` processes in the available memory; on GPUs, one
    process in a GPU's memory. `world_size`: the smallest the run may have (a rank then holds the most)."""
    runtime = MIB_PER_CPU_PROCESS if on_cpu else CUDA_CONTEXT_MIB
    need_mib = planned_peak_bytes(cfg, world_size) / 2**20 + runtime
    if on_cpu:
        have, where, total = available_mib(), "are available", nproc * need_mib
    else:
        have, where, total = gpu_mib(), "a GPU holds", need_mib
    if have is None or total <= have:
        return
    if cfg.model_size == "baby" and on_cpu:  # either baby model is nothing: too many processes is the trouble
        fit = int(have // need_mib)
        raise ConfigError(
            f"NPROC={nproc}: {nproc} CPU processes need ~{gb(total)} ({need_mib * MB_PER_MIB:.0f} MB each) but "
            f"{gb(have)} are available; at most {fit} fit, so use NPROC={max(fit, 1)} or fewer "
            f"(or free memory)"
        )
    instead = _what_fits(cfg, nproc=nproc, world_size=world_size, on_cpu=on_cpu, have=have, runtime=runtime)
    each = f"{nproc} processes x ~{gb(need_mib)}" if on_cpu else f"~{gb(need_mib)} per GPU"
    strategy = {
        "ddp": "DDP",
        "fsdp": f"FSDP {cfg.sharding}",
        "pippy": "the pipeline",
        "tp": "TP",
        "cp": "CP",
        "ep": "EP",
    }[cfg.strategy]
    raise ConfigError(
        f"--model-size {cfg.model_size}: {strategy} on {world_size} ranks needs {each} (its training state and the "
        f"peak of a step, as python -m planner plans it, and the runtime) but {gb(have)} {where}; {instead}"
    )


def _what_fits(cfg: Config, *, nproc: int, world_size: int, on_cpu: bool, have: float, runtime: float) -> str:
    """What to run instead, for this strategy and device: the first change that the same closed form lets through.
    On a CPU every process shares the machine's memory, so fewer processes need less for every strategy (DDP's are
    whole copies; a sharded strategy's shares add up to the same state, each process adds its runtime and its
    gathered unit). On GPUs a rank's share of FSDP, the pipeline or TP shrinks with more GPUs; DDP's never does."""
    model = f" --model {cfg.model}" if cfg.model != "cnn" else ""

    def each_mib(candidate: Config, ranks: int) -> float | None:  # None: not a run the flags allow
        return planned_peak_bytes(candidate, ranks) / 2**20 + runtime if would_start(candidate, ranks) else None

    blocks = replace(cfg, strategy="fsdp", sharding="full", shard_units="blocks")  # a share, one block whole
    to_blocks = f"bash run_fsdp.sh{model} --model-size {cfg.model_size} --shard-units blocks"
    if cfg.strategy == "fsdp":
        to_blocks = "--shard-units blocks (a block gathered at a time)"
    if on_cpu:  # the same processes sharded a block at a time, else fewer of them
        tries = [(blocks, nproc, to_blocks)] if cfg != blocks else []
        if nproc == world_size:
            tries += [(cfg, fewer, f"NPROC={fewer}, the same flags") for fewer in range(nproc - 1, 0, -1)]
    else:  # a GPU holds one rank: a block at a time, then more GPUs for a smaller share (DDP's never shrinks)
        tries = []
        for ranks in (world_size, 2 * world_size, 4 * world_size, 8 * world_size):
            where = f" on {ranks} GPUs (NPROC x NNODES)" if ranks > world_size else ""
            if ranks > world_size and cfg.strategy != "ddp":
                tries.append((cfg, ranks, f"the same flags{where}"))
            if cfg != blocks:
                tries.append((blocks, ranks, to_blocks + where))
    for candidate, ranks, command in tries:
        mib = each_mib(candidate, ranks)
        if mib is not None and mib * (ranks if on_cpu else 1) <= have:
            return f"this fits (~{gb(mib)} each): {command}"
    smaller = "a smaller --batch-size or --model-size"
    if cfg.strategy == "ddp" and not on_cpu:
        return f"DDP holds the whole model on every GPU, however many: {smaller}"
    return f"--activation-checkpointing or {smaller}" if cfg.strategy == "fsdp" else smaller
