"""Train BabyGPT with context parallelism (CP): every sequence split over the ranks, attention by a ring, FSDP over all.

    bash run_cp.sh --seq-len 1024                           # 4 processes: 4-way CP, GPUs + NCCL, else CPU + gloo
    bash run_cp.sh --seq-len 1024 --dp 2                    # 2 replicas x 2-way CP
    torchrun --standalone --nproc-per-node 4 train_cp.py    # the same as the first, by hand
    python train_cp.py --max-steps 50                       # 1 process, no torchrun needed

A replica's cp ranks train on the same sequences, each on 1/cp of every sequence's tokens: chunk r and chunk
2 cp - 1 - r of 2 cp, so that under the causal mask each rank has as much attention to compute. Everything but
attention works on a token alone; attention is ring attention (common/ring_attention.py): the keys and values go
round the ring while each rank attends to the chunk it holds. Activations shrink with cp, which FSDP and TP cannot
do for one long sequence; the parameters are sharded by FSDP over every rank, as torchtitan does (docs/
context-parallel.md). Lines specific to CP: `# [CP]`.
"""

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.language import IGNORE
from common.model import build_model
from common.recorder import RunRecorder
from common.ring_attention import BuiltinRing, RingAttention
from common.runs import total_steps
from common.training import build_optimizer, evaluate, global_mean, loss_scaler, low_precision, lr_at, set_lr
from train_fsdp import apply_fsdp, fsdp_mesh


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("cp", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        train(cfg, env)
    finally:
        teardown_distributed()


def apply_cp(attentions: Sequence[nn.Module], ring: Any) -> None:
    """[CP] The wrap: every attention of the model (`model.attentions()`) attends by `ring` (a RingAttention of
    common/ring_attention.py, a file of torch alone: copy it whole), which also gives it its tokens' global
    positions for the rotary embedding. The ring cuts the data (`ring.shard`) and puts logits back (`ring.gather`)."""
    for attention in attentions:
        attention.ring = ring  # [CP] (common/gpt.py: with a ring, attention is the ring's)


def cut_sequences(
    ring: Any, sequences: Sequence[torch.Tensor], *, torch_cp: DeviceMesh | None = None
) -> tuple[list[torch.Tensor], AbstractContextManager]:
    """[CP] This rank's head and tail chunk of each of `sequences` ([B, T] -> [B, T / cp]), and the context to run
    the model in: the written-out ring needs none. With `torch_cp` (--cp-attention torch, CUDA only), PyTorch's own
    context parallelism over that mesh: it cuts copies of them in place into the same chunks (its load balancer's
    default), and inside it scaled_dot_product_attention runs torch's ring."""
    if torch_cp is None:
        return [ring.shard(s) for s in sequences], nullcontext()
    from torch.distributed.tensor.experimental import context_parallel

    copies = [s.clone() for s in sequences]  # (cut in place: not the batch's views)
    inside = context_parallel(
        torch_cp, buffers=copies, buffer_seq_dims=[1] * len(copies), no_restore_buffers=set(copies)
    )
    return copies, inside


def share_of_loss(logits: torch.Tensor, targets: torch.Tensor, *, scored: torch.Tensor, cp: int) -> torch.Tensor:
    """[CP] This rank's share of its sequences' mean loss, times cp: the cross-entropy summed over its positions
    (logits [B, T / cp, V], targets [B, T / cp]) over the `scored` positions of the whole sequences. The ranks hold
    unequal shares of the scored positions (the copy task scores the second half), so each rank's own mean would
    weigh them wrongly; FSDP averages the gradients over the ranks, hence the cp."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum") * cp / scored


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    # [CP] A 2-D mesh: "dp" indexes the replicas, "cp" the ranks that split one replica's sequences (rank = replica
    # * cp + cp_rank: a ring's ranks are neighbours, on one machine where they can be)
    mesh = init_device_mesh(env.device.type, (cfg.dp, env.world_size // cfg.dp), mesh_dim_names=("dp", "cp"))
    replica, cp = mesh.get_local_rank("dp"), mesh["cp"].size()
    where = f"{env.device.type}/{env.backend} | torch {torch.__version__}"
    log(f"CP ({cfg.cp_attention}) | {env.world_size} processes = {cfg.dp} replica(s) x {cp} CP ranks on {where}")

    # ---- data: every rank holds the whole data set; the sampler gives each replica its slice of each batch
    data = load_dataset(cfg)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # the sequences this replica runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))
    log(f"sequences of {cfg.seq_len} tokens: {cfg.seq_len // cp} per CP rank, in 2 chunks of {cfg.seq_len // cp // 2}")

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    model = build_model(**cfg.model_kwargs(), **data.shape)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters")
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    # [CP] The ring of this replica's CP ranks; --cp-attention torch: the same chunks, torch's own ring inside SDPA
    ring = (BuiltinRing if cfg.cp_attention == "torch" else RingAttention)(mesh["cp"].get_group())
    apply_cp(model.attentions(), ring)  # [CP]
    torch_cp = mesh["cp"] if cfg.cp_attention == "torch" else None

    # [CP] FSDP over every rank, a unit per block: a replica's CP ranks hold the same parameters, so they shard
    # them too; their gradients, of different tokens, are averaged with the replicas' by the reduce-scatter
    flags = {"param_dtype": low_precision(cfg), "activation_checkpointing": cfg.activation_checkpointing}
    model = apply_fsdp(model, fsdp_mesh(env.device.type, env.world_size), units=model.blocks(), **flags)
    optimizer = build_optimizer(model.parameters(), cfg)
    scaler = loss_scaler(cfg)  # fp16: scales the loss; skips a step whose gradients overflowed

    # resume or start afresh, save every --checkpoint-every steps, and on a preemption signal save and stop
    checkpoints = Checkpoints(cfg, model, [optimizer], scaler, sampler=sampler, steps=steps, log=log)
    if (start_step := checkpoints.start()) is None:
        return  # a finished run: nothing to train, nothing rewritten
    # metrics.jsonl, the console, --tensorboard, --profile-steps, memory, run.json: all in the recorder
    recorder = RunRecorder(cfg, env, start_step=start_step, total_steps=steps, parameters=n_params, logs=env.is_main)
    recorder.track_memory(model.parameters(), optimizer)

    def run_eval(step: int) -> None:
        model.eval()  # (dropout off)

        def forward(x: torch.Tensor, _: torch.Tensor) -> torch.Tensor:
            (x,), inside = cut_sequences(ring, [x], torch_cp=torch_cp)  # [CP] each rank its tokens
            with inside:
                return ring.gather(model(x))  # [CP] every rank's logits, in sequence order

        # [CP] each replica its shard of the test set; its CP ranks count it alike, which the ratios do not mind
        test = evaluate(forward, data, part=replica, parts=cfg.dp, device=env.device)
        recorder.eval(step, *test)
        model.train()

    # ---- training loop
    model.train()
    for step in recorder.steps():
        lr = lr_at(step, cfg, last_step=steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        with recorder.span("data"):
            indices = sampler.rank_batch(step, replica, cfg.dp)  # [CP] this replica's slice of the global batch
            tokens, targets = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        for i, (x, y) in enumerate(zip(tokens.split(chunk_size), targets.split(chunk_size))):
            model.set_requires_gradient_sync(i == cfg.grad_accum_steps - 1)  # the reduce-scatter once, at the last
            scored = (y != IGNORE).sum()  # the scored positions of the whole sequences, on every CP rank alike
            (x, y), inside = cut_sequences(ring, [x, y], torch_cp=torch_cp)  # [CP] this rank's 2 chunks of each
            with inside:
                with recorder.span("forward"):  # [CP] the ring's sends show inside it
                    loss = share_of_loss(model(x), y, scored=scored, cp=cp) / cfg.grad_accum_steps  # [CP]
                with recorder.span("backward"):  # [CP] the keys and values go round again, with their gradients
                    scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # clip by the whole gradient's norm: a DTensor sharded over every rank, the squares added over them
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, loss_scale=scaler.value)
        with recorder.span("optimizer"):
            scaler.step(optimizer, grad_norm)  # fp16: not if the gradients overflowed (the same on every rank)
        # a replica's ranks' shares add up to its mean loss: the mean over all ranks is the global batch's
        recorder.train(step, loss=global_mean(loss_sum), lr=lr, grad_norm=grad_norm, scaler=scaler)
        if recorder.eval_due(step):
            run_eval(step)
        if checkpoints.end_of_step(step, recorder):
            return  # stopped by a preemption signal, with this step's checkpoint

    run_eval(steps)
    cp_section = {"attention": cfg.cp_attention, "tokens_per_rank": cfg.seq_len // cp}
    recorder.finish(mesh={"dp": cfg.dp, "cp": cp}, cp=cp_section)


if __name__ == "__main__":
    run(main)
