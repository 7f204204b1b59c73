"""Train BabyGPT's mixture of experts with expert parallelism (EP): the experts spread over ranks, tokens sent to them.

    bash run_ep.sh                                          # 4 processes: 8 experts, 2 on each rank
    bash run_ep.sh --ep 2                                   # 2 groups of 2 EP ranks, 4 experts on each rank
    torchrun --standalone --nproc-per-node 4 train_ep.py    # the same as the first, by hand
    python train_ep.py --max-steps 50                       # 1 process, every expert on it

Every rank trains on its own slice of each batch, as under FSDP. Each MoE layer's router picks every token's top-k
experts; the experts are spread over the --ep ranks of a group, so each layer sends every token to the rank that
holds its expert (all_to_all_single, uneven: as the router chose), runs the experts it holds, and sends the
results back (common/expert_parallel.py). The dense parts (attention, norms, routers, embedding, output layer) are
sharded by FSDP over every rank, as torchtitan's dp2ep does (docs/moe.md). Lines specific to EP: `# [EP]`.
"""

from typing import Callable, Sequence

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from common.checkpoint import Checkpoints
from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.config import Config
from common.data import GlobalBatchSampler, describe_data, load_dataset, to_device_batch
from common.distributed import DistEnv, RankLogger, run, setup_distributed, teardown_distributed
from common.expert_parallel import ExpertParallel
from common.model import build_model
from common.moe import aux_loss, routed, routing_record
from common.recorder import RunRecorder
from common.runs import total_steps
from common.training import build_optimizer, evaluate, global_mean, loss_fn, loss_scaler, low_precision, lr_at, set_lr
from train_fsdp import apply_fsdp, fsdp_mesh


def main(argv: list[str] | None = None) -> None:
    cfg = parse_config("ep", argv)
    env = setup_distributed(
        device=cfg.device, timeout_s=cfg.timeout_s, threads=cfg.threads, preempt_signal=cfg.preempt_signal
    )
    try:
        cfg.check(world_size=env.world_size, device_type=env.device.type)
        train(cfg, env)
    finally:
        teardown_distributed()


def apply_ep(
    moes: Sequence[nn.Module], mesh: DeviceMesh, dispatch: Callable, *, param_dtype: torch.dtype | None = None
) -> None:
    """[EP] The wrap: every MoE layer (`model.moes()`) keeps this rank's E / ep experts, a DTensor split by expert
    over mesh["ep"], and sends its tokens to them with `dispatch` (common/expert_parallel.py's ExpertParallel over
    mesh["ep"], a file of torch alone: copy it whole). Each layer's experts are then an FSDP unit over mesh["dp"]:
    the groups' copies of these experts shard them further, as FSDP x TP shards TP's halves (torchtitan's dp2ep), so
    a rank keeps 1 / world of them. `param_dtype`: FSDP's mixed precision, as the dense parts' (train_fsdp.py)."""
    ep, rank = mesh["ep"].size(), mesh.get_local_rank("ep")
    mixed = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for moe in moes:
        experts = moe.experts  # [EP] gate, up [E, D, H] and down [E, H, D]: this rank keeps rows rank E/ep..
        for name, weight in list(experts.named_parameters()):
            mine = weight.detach().chunk(ep)[rank].to(mesh.device_type)
            setattr(experts, name, nn.Parameter(DTensor.from_local(mine, mesh["ep"], [Shard(0)])))
        moe.ep = dispatch  # [EP] (common/moe.py: with a dispatch, the tokens go where their experts are)
        fully_shard(experts, mesh=mesh["dp"], mp_policy=mixed)  # [EP] before the blocks: a unit of its own
        # [EP] An expert's gradient holds the tokens of every rank of its EP group (backward sent theirs back); the
        # reduce-scatter sums it over the groups, and over the world size it is the global batch's mean, as FSDP
        # makes the dense parts' (its own divisor would be the groups' count)
        experts.set_gradient_divide_factor(float(mesh.size()))
        # gloo has no pre-multiplied sum (NCCL's PreMulSum): a sum, then the division (not on 1 rank, where FSDP
        # divides once already and would divide again, torch 2.14.1)
        if mesh.device_type == "cpu" and mesh["dp"].size() > 1:
            experts.set_force_sum_reduction_for_comms(True)


def train(cfg: Config, env: DistEnv) -> None:
    log = RankLogger(env.is_main)
    # [EP] A 2-D mesh for the experts: "ep" the ranks that split one copy of them (neighbours: the all-to-alls stay on
    # one machine where they can), "dp" the copies
    ep = cfg.ep or env.world_size
    mesh = init_device_mesh(env.device.type, (env.world_size // ep, ep), mesh_dim_names=("dp", "ep"))
    where = f"{env.device.type}/{env.backend} | torch {torch.__version__}"
    log(f"EP | {env.world_size} processes = {mesh['dp'].size()} group(s) x {ep} EP ranks on {where}")

    # ---- data: every rank holds the whole data set; the sampler gives each rank its slice of each batch
    data = load_dataset(cfg)
    sampler = GlobalBatchSampler(len(data.train), cfg.batch_size, seed=cfg.seed)
    steps = total_steps(cfg, sampler.steps_per_epoch)
    chunk_size = cfg.chunk_size(env.world_size)  # what this rank runs per accumulation step
    log(describe_data(data, sampler, split=cfg.batch_split(env.world_size), steps=steps))

    # ---- model: the same initial weights on every rank, because they depend on the seed alone
    model = build_model(**cfg.model_kwargs(), **data.shape)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"{type(model).__name__} {cfg.model_size}: {n_params:,} parameters, {cfg.experts} experts per block")
    log(
        f"each rank runs {cfg.experts // ep} experts per block, their weights sharded over {env.world_size // ep} "
        f"group(s) by FSDP; each token runs through {cfg.top_k}"
    )
    torch.manual_seed(cfg.seed + env.rank)  # after building: same weights, but each rank its own dropout masks
    moes = model.moes()
    apply_ep(moes, mesh, ExpertParallel(mesh["ep"].get_group()), param_dtype=low_precision(cfg))  # [EP]
    # [EP] FSDP over every rank, a unit per block, for the dense parts (the experts are units of their own already)
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
        # [EP] every rank makes as many forward calls (evaluate pads a short shard): each is two all-to-alls a layer
        test = evaluate(lambda x, _: model(x), data, part=env.rank, parts=env.world_size, device=env.device)
        recorder.eval(step, *test)
        model.train()

    # ---- training loop
    model.train()
    for step in recorder.steps():
        lr = lr_at(step, cfg, last_step=steps)
        set_lr(optimizer, lr)
        optimizer.zero_grad(set_to_none=True)
        with recorder.span("data"):
            indices = sampler.rank_batch(step, env.rank, env.world_size)  # this rank's slice of the global batch
            tokens, targets = to_device_batch(data.train, indices, data, env.device)
        loss_sum = torch.zeros((), device=env.device)
        counts = torch.zeros(len(moes), cfg.experts + 1, dtype=torch.long, device=env.device)  # [EP] the routing
        for i, (x, y) in enumerate(zip(tokens.split(chunk_size), targets.split(chunk_size))):
            model.set_requires_gradient_sync(i == cfg.grad_accum_steps - 1)  # the reduce-scatter once, at the last
            with recorder.span("forward"):  # [EP] the all-to-alls show inside it
                # the balance losses join the model's (each a mean over sequences, like the loss)
                loss = (loss_fn(model(x), y) + aux_loss(moes)) / cfg.grad_accum_steps
            counts += routed(moes)  # tokens per expert, read before backward recomputes a checkpointed block
            with recorder.span("backward"):  # [EP] the gradients take the all-to-alls back
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        # clip by the whole gradient's norm: the dense parts sharded over every rank, the experts over "dp" and "ep"
        grad_norm = clip_grad_norm(model.parameters(), cfg.max_grad_norm, loss_scale=scaler.value)
        with recorder.span("optimizer"):
            scaler.step(optimizer, grad_norm)  # fp16: not if the gradients overflowed (the same on every rank)
        recorder.train(
            step, loss=global_mean(loss_sum), lr=lr, grad_norm=grad_norm, scaler=scaler, **routing_record(counts)
        )
        if recorder.eval_due(step):
            run_eval(step)
        if checkpoints.end_of_step(step, recorder):
            return  # stopped by a preemption signal, with this step's checkpoint

    run_eval(steps)
    recorder.finish(mesh={"dp": mesh["dp"].size(), "ep": ep}, ep={"experts_per_rank": cfg.experts // ep})


if __name__ == "__main__":
    run(main)
