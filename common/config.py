"""One configuration for all four scripts: every flag is a field of `Config`, its help the docstring under it
(common/cli.py builds the command line), validated in `Config.check`; a flag may exist only in some scripts
(`STRATEGY_FLAGS`) and means the same wherever it does. No torch here: the runners check flags before torchrun."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

from common.errors import ConfigError

# --model-size: (width of the classifier's hidden layers, how many); common/model_sizes.py has what each holds
MODEL_SIZES = {
    "baby": (128, 1),  # 1.27 M parameters: the suite's BabyCNN, the default
    "small": (1024, 4),  # 12.7 M
    "medium": (4096, 8),  # 155 M: DDP's training state, 2.5 GB per rank, fits 4 CPU processes in 24 GiB
    "large": (8192, 8),  # 546 M: DDP's 8.7 GB per rank does not fit 4 processes in 24 GiB; FSDP's 2.2 GB does
    "7b": (16384, 27),  # 7.1 B: for planning on GPUs (the textbook's 7 B)
}
MODELS = ("cnn", "vit", "gpt")  # the ViT's and BabyGPT's sizes: common/vit_sizes.py, common/gpt_sizes.py
# What each model trains with unless told otherwise (the ViT's recipe: docs/transformer.md; BabyGPT's:
# docs/language.md)
MODEL_DEFAULTS = {
    "cnn": {"dataset": "digits", "epochs": 2, "lr_schedule": "constant", "shard_units": "model"},
    "vit": {"dataset": "digits", "epochs": 8, "lr_schedule": "cosine", "shard_units": "blocks"},
    "gpt": {"dataset": "copy", "epochs": 2, "lr_schedule": "cosine", "shard_units": "blocks", "seq_len": 64},
}
IMAGE_DATASETS = ("digits", "mnist", "fashion-mnist", "cifar10")
TEXT_DATASETS = ("copy", "text")  # BabyGPT's: the built-in copy task, a --data-file
GPT_FLAGS = ("seq_len", "kv_heads", "data_file", "experts")  # flags of BabyGPT alone
OPTIMIZERS = ("sgd", "adamw")
SHARDINGS = ("full", "grad-op", "hybrid", "none")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "looped-bfs", "interleaved-zb", "zbv", "dualpipev")
STRATEGIES = ("ddp", "fsdp", "pippy", "tp", "cp", "ep")
BATCH_TOO_BIG = "the global batch {} is larger than the training set ({} samples); use a smaller batch or more data"
PREEMPT_SIGNALS = ("USR1", "USR2")  # SIGTERM is always one; SIGINT (Ctrl-C) stops at once, without a checkpoint
CHOICES = {  # flag -> (what it names, its values)
    "dataset": ("data set", (*IMAGE_DATASETS, *TEXT_DATASETS)),
    "model": ("model", MODELS),
    "optimizer": ("optimizer", OPTIMIZERS),
    "precision": ("precision", ("fp32", "bf16", "fp16")),
    "device": ("device", ("auto", "cpu", "cuda")),
    "sharding": ("mode", SHARDINGS),
    "shard_units": ("unit", ("auto", "model", "blocks")),
    "schedule": ("schedule", SCHEDULES),
    "lr_schedule": ("schedule", ("auto", "constant", "cosine", "linear")),
    "allreduce": ("all-reduce", ("builtin", "ring")),
    "cp_attention": ("attention", ("ring", "torch")),
    "preempt_signal": ("signal", PREEMPT_SIGNALS),
}
# Counts that must be at least 1, and those where 0 means something of its own (said in the error)
AT_LEAST_ONE = (
    *("train_size", "test_size", "batch_size", "grad_accum_steps", "log_every", "timeout_s"),
    *("n_microbatches", "stages_per_rank", "dp", "tp", "loss_scale_growth_interval"),
)
ZERO_MEANS = {
    "epochs": "the model's own",
    "patch_size": "the size's own",
    "heads": "the size's own",
    "kv_heads": "as many as --heads, or the size's own",
    "seq_len": "the model's own",
    "experts": "dense",
    "top_k": "2, or 1 with one expert",
    "ep": "every rank",
    "max_steps": "no limit",
    "warmup_steps": "none",
    "eval_every": "only at the end",
    "checkpoint_every": "never",
    "keep": "keep all",
    "threads": "automatic",
}


@dataclass
class Config:
    # --- data ---
    dataset: str = "auto"
    """Data set. Images: digits (built in, offline, deterministic; the default), mnist, fashion-mnist or cifar10
    (torchvision). --model gpt: copy (built in: random tokens, then copied; the default) or text (--data-file)."""
    data_file: str = ""
    """gpt: train on this text file, as bytes (a vocabulary of 256), its last tenth the test split."""
    data_dir: str = "data"
    """Where torchvision data sets are read from (and downloaded to, when online)."""
    train_size: int = 12800
    """Number of training images (sequences) of the built-in digits (copy) data set."""
    test_size: int = 2000
    """Number of test images (sequences) of the built-in digits (copy) data set."""
    seq_len: int = 0
    """gpt: tokens per sequence, the context (0: the model's own, 64)."""

    # --- model ---
    model: str = "cnn"
    """cnn (BabyCNN: two convolutions and a classifier), vit (BabyViT: a Vision Transformer, blocks of attention
    and MLP: docs/transformer.md) or gpt (BabyGPT: a Llama-style decoder language model: docs/language.md)."""
    model_size: str = "baby"
    """The model's size. cnn: baby (1.3 M parameters), small (13 M), medium (155 M), large (546 M), 7b (7.1 B). vit:
    baby (0.3 M), small (6 M), medium (202 M), large (680 M); ti16, s16, b16, l16, h14, g14, 22b, the published
    ViTs, for python -m planner (it says what each needs per rank). gpt: baby (0.1 M), small (4.5 M), medium
    (189 M); gpt2-124m, llama3-8b, llama3-70b, llama3-405b, the published shapes, for python -m planner."""
    patch_size: int = 0
    """vit: the patch's side in pixels (0: the size's own); it must divide the images' side."""
    heads: int = 0
    """vit, gpt: attention heads per block (0: the size's own); they must divide the width."""
    kv_heads: int = 0
    """gpt: key/value heads per block, each shared by --heads / --kv-heads query heads (0: as many as --heads if
    given, else the size's own); they must divide --heads."""
    experts: int = 0
    """gpt: a mixture of experts: this many SwiGLU experts in each block in place of its MLP, each token routed
    to --top-k of them (0: dense; docs/moe.md)."""
    top_k: int = 0
    """--experts: the experts each token runs through, weighed by the router's renormalised scores (0: 2)."""
    shared_expert: bool = False
    """--experts: also a shared expert that every token runs through (DeepSeek's)."""
    capacity_factor: float = 0.0
    """--experts: a sequence sends each expert at most ceil(factor x seq-len x top-k / experts) tokens, the rest
    dropped and counted (0: dropless)."""
    aux_loss_coef: float = 0.01
    """--experts: the weight of the balance loss (1 when a sequence spreads its tokens evenly) in the loss."""

    # --- schedule ---
    epochs: int = 0
    """Passes over the training set (0: the model's own, 2 for cnn and gpt, 8 for vit; --max-steps stops earlier)."""
    max_steps: int = 0
    """Stop after this many optimizer steps (0: no limit, run --epochs)."""
    batch_size: int = 128
    """GLOBAL batch size: samples per optimizer step summed over all ranks, the same in every strategy."""
    grad_accum_steps: int = 1
    """Split each global batch into this many sequential chunks whose gradients are accumulated."""

    # --- optimization ---
    optimizer: str = "adamw"
    """Optimizer: sgd (momentum 0.9) or adamw."""
    lr: float = 2e-3
    """Peak learning rate, reached after --warmup-steps (then kept, or decayed by --lr-schedule)."""
    weight_decay: float = 0.0
    """Weight decay (decoupled for adamw, L2 for sgd)."""
    warmup_steps: int = 20
    """Linear learning-rate warm-up from lr/warmup_steps to lr over this many steps (0: none)."""
    lr_schedule: str = "auto"
    """After warm-up: constant (keep --lr), or cosine / linear decay from --lr to --min-lr at the last step (auto: the
    model's own: constant for cnn, cosine for vit)."""
    min_lr: float = 0.0
    """Learning rate at the run's last step with --lr-schedule cosine or linear."""
    max_grad_norm: float = 0.0
    """Clip gradients to this global L2 norm, over the whole model, once per optimizer step (0: off)."""
    compile: bool = False
    """torch.compile the model (DDP: the wrapped model; FSDP: before sharding, a graph per unit; pipeline: each stage;
    TP: after the split, with static shapes)."""
    dropout: float = 0.1
    """Dropout probability (cnn: in the classifier; vit: in each MLP); 0 makes runs comparable step by step."""
    seed: int = 0
    """Seed for the data set, the shuffling and the initial weights: the same seed gives the same run."""
    precision: str = "fp32"
    """Compute precision: fp32, bf16 or fp16 (autocast; FSDP: parameters in that dtype); fp16 scales the loss."""
    loss_scale: float = 65536.0
    """fp16: the initial loss scale, a power of two; halved on a step whose gradients overflow (the step is
    skipped), doubled after --loss-scale-growth-interval steps in a row that do not."""
    loss_scale_growth_interval: int = 2000
    """fp16: steps without overflow after which the loss scale doubles."""

    # --- DDP ---
    allreduce: str = "builtin"
    """DDP: how the gradient buckets are all-reduced: builtin (gloo's or NCCL's) or ring (common/ring.py, written out
    in point-to-point sends, as a DDP communication hook)."""

    # --- FSDP ---
    sharding: str = "full"
    """FSDP sharding: full (ZeRO-3), grad-op (ZeRO-2), hybrid (HSDP, 2-D mesh) or none (replicate, like DDP)."""
    shard_units: str = "auto"
    """FSDP: what each all-gather gathers: the model (one unit: fewest collectives), blocks (a unit per block: the
    weights exist whole a block at a time, for models too big to gather at once) or auto (cnn: model, vit: blocks)."""
    cpu_offload: bool = False
    """FSDP: keep sharded parameters, gradients and optimizer state in CPU memory (for GPU runs)."""
    activation_checkpointing: bool = False
    """FSDP, CP: keep only each unit's input for backward and recompute its activations (BabyCNN: one span)."""

    # --- pipeline ---
    schedule: str = "1f1b"
    """Pipeline schedule: gpipe, 1f1b, interleaved-1f1b, looped-bfs, interleaved-zb, zbv or dualpipev."""
    n_microbatches: int = 4
    """Pipeline: micro-batches each pipeline replica's batch is split into."""
    stages_per_rank: int = 1
    """Pipeline: stages on each rank (2 or more for the interleaved, looped and V schedules)."""
    dp: int = 1
    """Pipeline, TP and CP: number of data-parallel replicas (world size = dp x pipeline, TP or CP ranks); TP
    shards its replicas with FSDP (FSDP x TP); CP shards over every rank."""
    tp: int = 1
    """Pipeline: TP ranks splitting each stage's blocks (world size = dp x pipeline x TP ranks); CP: refused."""
    sequence_parallel: bool = False
    """TP, --model vit: LayerNorms and residual stream on a share of the tokens per TP rank (docs/tp.md)."""
    cp_attention: str = "ring"
    """CP: ring (written out in common/ring_attention.py, any device) or torch (PyTorch's context_parallel: CUDA)."""
    ep: int = 0
    """EP: ranks the experts are spread over (0: every rank), FSDP sharding each one's over the world / --ep groups."""

    # --- output, logging, checkpoints ---
    out: str = ""
    """Output folder for metrics.jsonl, run.json and checkpoints (default: runs/<strategy>)."""
    log_every: int = 20
    """Print a progress line every this many steps."""
    eval_every: int = 0
    """Evaluate on the whole test set every this many steps (0: only at the end)."""
    checkpoint_every: int = 0
    """Write a checkpoint every this many steps (0: never)."""
    keep: int = 0
    """Keep only the newest this many checkpoints, deleting older ones after each save (0: keep all)."""
    resume: bool = False
    """Continue from the latest complete checkpoint in --out."""
    profile_steps: str = ""
    """Profile steps A:B (e.g. 3:5) with torch.profiler, a Chrome trace per rank in <out>/traces/ (empty: off)."""
    memory_snapshot: bool = False
    """CUDA only: record the allocator over --profile-steps into <out>/traces/ (for pytorch.org/memory_viz)."""
    tensorboard: bool = False
    """Also write every train and eval record as TensorBoard scalars under <out>/tensorboard/."""
    measure_peak: bool = False
    """CPU: measure the most tensor bytes each rank holds during one step (the launch's second) into run.json, the
    figure python -m planner predicts (on GPUs run.json always has the CUDA allocator's peak)."""

    # --- runtime ---
    device: str = "auto"
    """auto (CUDA when every local rank has a GPU, else CPU), cpu or cuda."""
    threads: int = 0
    """CPU threads per process (0: the machine's cores divided by the local processes)."""
    timeout_s: int = 300
    """Process-group timeout in seconds: a rank stuck this long in a collective ends the job."""
    preempt_signal: str = "USR1"
    """The signal that, like SIGTERM, makes every rank finish its step, save a checkpoint and stop (SLURM's
    --signal): USR1 or USR2."""

    strategy: str = dataclasses.field(default="ddp", metadata={"cli": False})

    def __post_init__(self) -> None:  # what the model trains with where a flag was left at 0 or auto
        from common.gpt_sizes import GPT_SIZES  # (no torch)

        shape = GPT_SIZES.get(self.model_size) if self.model == "gpt" else None
        if shape and shape.experts and not self.experts:  # a size with experts (Mixtral's): its own, unless flagged
            self.experts, self.top_k, self.shared_expert = shape.experts, self.top_k or shape.top_k, shape.shared
        if self.experts and not self.top_k:
            self.top_k = min(2, self.experts)  # (Mixtral's 2 of 8)
        if self.data_file and self.dataset == "auto":
            self.dataset = "text"  # --data-file says which data set
        for name, own in MODEL_DEFAULTS.get(self.model, MODEL_DEFAULTS["cnn"]).items():
            setattr(self, name, own if getattr(self, name) in (0, "auto") else getattr(self, name))

    # ------------------------------------------------------------------ checks
    def check(self, *, world_size: int | None = None, device_type: str | None = None) -> "Config":
        """Raise ConfigError for the first bad value; `world_size` adds the checks that depend on it, and
        `device_type` ("cpu" or "cuda": a worker knows it, the preflight guesses it) settles --device auto."""

        def need(ok: bool, flag: str, problem: str) -> None:
            if not ok:
                raise ConfigError(f"--{flag.replace('_', '-')}: {problem}")

        for name, (what, choices) in CHOICES.items():
            value = getattr(self, name)
            need(value in choices, name, f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
        self.check_model()
        for name in AT_LEAST_ONE:
            need(getattr(self, name) >= 1, name, f"must be at least 1, got {getattr(self, name)}")
        for name, zero in ZERO_MEANS.items():
            value = getattr(self, name)
            need(value >= 0, name, f"must be 0 ({zero}) or positive, got {value}")
        need(0 < self.lr < float("inf"), "lr", f"must be a positive number, got {self.lr}")  # (nan is not)
        need(0 <= self.weight_decay < float("inf"), "weight-decay", f"must be 0 or positive, got {self.weight_decay}")
        need(0 <= self.min_lr <= self.lr, "min-lr", f"must be in [0, --lr {self.lr}], got {self.min_lr}")
        norm = self.max_grad_norm
        need(0 <= norm < float("inf"), "max-grad-norm", f"must be 0 (off) or positive, got {norm}")
        scaled = self.precision == "fp16" or (self.loss_scale, self.loss_scale_growth_interval) == (65536.0, 2000)
        need(scaled, "loss-scale", "only --precision fp16 scales the loss; add it, or drop the flag")
        power = self.loss_scale >= 1 and math.log2(self.loss_scale).is_integer()  # (False for inf and nan)
        need(power, "loss-scale", f"must be a power of two, 1 or more (e.g. 65536), got {self.loss_scale}")
        need(0 <= self.dropout < 1, "dropout", f"must be in [0, 1), got {self.dropout}")
        from common.moe_checks import check_moe  # --experts and its flags (common/moe_checks.py: no torch)

        check_moe(self, world_size=world_size)
        from common.versions import check_torch  # the installed torch: read from its metadata, not imported

        check_torch(self.strategy, tp=self.tp, schedule=self.schedule)
        if self.profile_steps or self.memory_snapshot or self.tensorboard:
            from common.optional_checks import check_observability  # only with a flag, like the features themselves

            on_cpu = (device_type or self.device) == "cpu"
            check_observability(
                self.profile_steps, memory_snapshot=self.memory_snapshot, tensorboard=self.tensorboard, on_cpu=on_cpu
            )
        if self.compile and device_type:
            from common.optional_checks import require_compiler

            require_compiler(device_type)
        # the built-in data set's size is a flag, so this is known before any worker starts (for the
        # torchvision ones the sampler says the same once the data is loaded)
        too_big = self.dataset in ("digits", "copy") and self.batch_size > self.train_size
        need(not too_big, "batch-size", BATCH_TOO_BIG.format(self.batch_size, self.train_size))
        problem = f"{self.grad_accum_steps} does not divide --batch-size {self.batch_size}"
        need(self.batch_size % self.grad_accum_steps == 0, "grad-accum-steps", problem)
        if world_size is not None:
            self.check_world_size(world_size)
        if self.strategy == "cp":
            from common.cp_checks import check_cp  # train_cp.py's own: its model, --seq-len, --compile

            flags = {name: getattr(self, name) for name in ("seq_len", "compile", "cp_attention", "dp", "tp")}
            check_cp(self.model, **flags, device=device_type or self.device, world_size=world_size)
        return self

    def check_model(self) -> None:
        """The size is one of the model's, and so are its flags and its data (what the ViT's and BabyGPT's shapes
        allow: model_sizes.py)."""
        sizes: dict = MODEL_SIZES
        if self.model == "vit":
            from common.vit_sizes import VIT_SIZES as sizes
        if self.model == "gpt":
            from common.gpt_sizes import GPT_SIZES as sizes
        if self.model_size not in sizes:
            raise ConfigError(
                f"--model-size: unknown {self.model} size {self.model_size!r}; choose one of {', '.join(sizes)}"
            )
        if self.model == "cnn" and (self.patch_size or self.heads):
            flag = "--patch-size" if self.patch_size else "--heads"
            raise ConfigError(f"{flag}: a flag of the ViT (--model vit); BabyCNN has no patches or heads: drop it")
        if self.strategy == "ep" and self.model != "gpt":  # (before its default --experts 8 is called a GPT flag)
            raise ConfigError("--model: expert parallelism spreads BabyGPT's experts; use --model gpt (its default)")
        given = [name for name in GPT_FLAGS if getattr(self, name)]
        if self.model != "gpt" and given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag}: a flag of BabyGPT (--model gpt), not of the {self.model}: drop it")
        if (self.dataset in TEXT_DATASETS) != (self.model == "gpt"):
            fits, what = (TEXT_DATASETS, "sequences") if self.model == "gpt" else (IMAGE_DATASETS, "images")
            raise ConfigError(
                f"--dataset: the {self.model} trains on {what}, not {self.dataset}; choose one of {', '.join(fits)}"
            )
        if self.model == "gpt":
            from common.gpt_sizes import check_gpt  # its shape, --seq-len, --data-file

            check_gpt(
                self.model_size,
                **{name: getattr(self, name) for name in ("heads", "kv_heads", "seq_len", "dataset", "data_file")},
                patch_size=self.patch_size,
                strategy=self.strategy,
            )

    def model_kwargs(self) -> dict[str, object]:
        """build_model's arguments from the flags (the data set gives the images' shape, or the vocabulary and the
        sequences' length)."""
        own = {"vit": {"patch_size": self.patch_size}, "gpt": {"kv_heads": self.kv_heads}}.get(self.model, {})
        if self.experts:  # common/moe.py's MoE in every block
            names = ("experts", "top_k", "capacity_factor")
            moe = {name: getattr(self, name) for name in names} | {"shared": self.shared_expert}
            own |= {"moe": moe | {"aux_coef": self.aux_loss_coef}}
        own |= {"heads": self.heads} if self.model != "cnn" else {}
        return {"model": self.model, "size": self.model_size, "seed": self.seed, "dropout": self.dropout, **own}

    def check_world_size(self, world_size: int) -> None:
        """The checks that need the number of processes: every rank must get an equal share of a batch. (What a
        pipeline's or TP's layout needs, they check themselves, in train_pippy.py and train_tp.py, and the
        runners' preflight before torchrun.)"""
        replicas = self.data_parallel_size(world_size)
        if self.strategy in ("pippy", "tp", "cp") and world_size % (self.dp * self.tp):
            what = f"{self.dp}" if self.tp == 1 else f"{self.dp} x --tp {self.tp} = {self.dp * self.tp}"
            use = "a --dp that divides it" if self.tp == 1 else "a --dp and a --tp whose product divides it"
            raise ConfigError(f"--dp: {what} does not divide the world size {world_size}; use {use}")
        if (self.batch_size // self.grad_accum_steps) % replicas:
            what = "data-parallel replicas (--dp)" if self.strategy in ("pippy", "tp", "cp") else "processes"
            raise ConfigError(
                f"--batch-size: the global batch {self.batch_size} (/ --grad-accum-steps {self.grad_accum_steps}) "
                f"does not split evenly over {replicas} {what}; use a multiple of {replicas * self.grad_accum_steps}"
            )
        if self.strategy == "fsdp" and self.sharding == "hybrid" and (world_size < 2 or world_size % 2):
            raise ConfigError(f"--sharding: hybrid needs an even world size (2 replicas x shards), got {world_size}")

    def flags(self) -> dict[str, object]:
        """The settings that are flags of this run's script (for run.json)."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.name == "strategy" or self.strategy in STRATEGY_FLAGS.get(f.name, STRATEGIES)
        }

    def data_parallel_size(self, world_size: int) -> int:
        """How many ranks split each global batch (the pipeline and TP split it only across their replicas)."""
        return self.dp if self.strategy in ("pippy", "tp", "cp") else world_size

    def chunk_size(self, world_size: int) -> int:
        """Samples a data-parallel rank (pipeline, TP: replica) runs per accumulation step (then micro-batches)."""
        return self.batch_size // self.data_parallel_size(world_size) // self.grad_accum_steps

    def batch_split(self, world_size: int) -> str:
        """How the global batch splits, for the start-up line: "4 ranks x 1 accumulation steps x 32"."""
        chunk = self.chunk_size(world_size)
        if self.strategy == "pippy":
            m = self.n_microbatches
            return f"{self.dp} replicas x {self.grad_accum_steps} accumulation steps x {m} micro-batches x {chunk // m}"
        if self.strategy in ("tp", "cp"):
            ranks, steps, name = world_size // self.dp, self.grad_accum_steps, self.strategy.upper()
            return f"{self.dp} replicas x {steps} accumulation steps x {chunk} (the same on its {ranks} {name} ranks)"
        return f"{world_size} ranks x {self.grad_accum_steps} accumulation steps x {chunk}"


# Flags that exist only in some scripts; all other fields are flags of every script.
STRATEGY_FLAGS = {
    "allreduce": ("ddp",),
    **dict.fromkeys(("sharding", "shard_units", "cpu_offload"), ("fsdp",)),
    "activation_checkpointing": ("fsdp", "cp", "ep"),  # (train_ep.py wraps its blocks as FSDP does)
    **dict.fromkeys(("schedule", "n_microbatches", "stages_per_rank"), ("pippy",)),
    "tp": ("pippy", "cp"),  # (CP: to refuse it in one line, saying why)
    "dp": ("pippy", "tp", "cp"),
    "sequence_parallel": ("tp",),
    "cp_attention": ("cp",),
    "ep": ("ep",),
}
