"""Pipeline parallelism (PP) in a plain training loop: torch alone, nothing of this suite.

    torchrun --standalone --nproc-per-node 4 loops/pipeline.py   # 4 stages: a GPU each + NCCL, else CPU + gloo
    python loops/pipeline.py                                      # 1 process, one stage, no torchrun needed

The model is cut between its blocks into a stage per rank; each global batch streams through the stages in
micro-batches, one forward and one backward at a time (1F1B), and the micro-batches are the gradient accumulation.
Model, data and seed are those of every loop in loops/: all print the same losses. Lines specific to the pipeline
are marked `# [PP]`; `apply_pipeline` is train_pippy.py's wrap without its options (docs/copying.md).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

N_IN, DIM, HIDDEN, N_BLOCKS, N_CLASSES = 16, 32, 64, 4, 8
MAX_GRAD_NORM = 1.0  # the whole model's gradient is clipped to this L2 norm
LAST_MEETING: list[dist.Work] = []  # the teardown's all-reduce, kept until the process exits (main)


class Block(nn.Module):  # a transformer's MLP half: widen, a nonlinearity, narrow, added back to the residual stream
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def make_model() -> nn.Sequential:  # the input layer, the blocks, the head
    torch.manual_seed(0)  # the same initial weights on every rank, and in every loop
    return nn.Sequential(nn.Linear(N_IN, DIM), *(Block() for _ in range(N_BLOCKS)), nn.Linear(DIM, N_CLASSES))


def global_batch(step: int, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank, whatever the world size; the labels follow a fixed linear teacher."""
    teacher = torch.randn(N_IN, N_CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(batch_size, N_IN, generator=torch.Generator().manual_seed(step))
    return x, (x @ teacher).argmax(dim=1)


def setup() -> torch.device:
    """Join torchrun's process group (without torchrun: a world of one); the device from LOCAL_RANK, never RANK."""
    local_rank, local_world_size = int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    if torch.cuda.device_count() >= local_world_size:  # a GPU per process: NCCL
        device, backend = torch.device("cuda", local_rank), "nccl"
        torch.cuda.set_device(device)
    else:
        device, backend = torch.device("cpu"), "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))  # the processes share the cores
    if "RANK" in os.environ:
        dist.init_process_group(backend)  # torchrun's RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device


def fail(message: str) -> None:
    """Bad input: one line, from rank 0 (every rank finds it), and exit 2 before any process group exists."""
    if os.environ.get("RANK", "0") == "0":
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def apply_pipeline(
    modules: dict[int, nn.Module], n_stages: int, pp_group: dist.ProcessGroup, device: torch.device
) -> list[PipelineStage]:
    # [PP] A stage for each {stage index: module} this rank holds; it sends and receives over pp_group
    return [PipelineStage(module, i, n_stages, device, group=pp_group) for i, module in modules.items()]


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, n_stages = dist.get_rank(), dist.get_world_size()  # [PP] a stage per rank
    layers = list(make_model())
    # [PP] The cut, between blocks: the first stage also holds the input layer, the last the head
    cuts = [0, *(1 + N_BLOCKS * s // n_stages for s in range(1, n_stages)), len(layers)]
    stage = nn.Sequential(*layers[cuts[rank] : cuts[rank + 1]]).to(device)  # [PP] this rank's layers only
    stages = apply_pipeline({rank: stage}, n_stages, dist.group.WORLD, device)  # [PP]
    first, last = rank == 0, rank == n_stages - 1

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # [PP] Each micro-batch's mean / their number: the losses, and so the gradients, add up to the batch mean's
        return F.cross_entropy(logits, labels) / args.accum

    # [PP] scale_grads=False: loss_fn divides already (True would divide the summed gradients again)
    schedule = Schedule1F1B(stages[0], n_microbatches=args.accum, loss_fn=loss_fn, scale_grads=False)
    params = list(stage.parameters())
    optimizer = torch.optim.SGD(params, lr=args.lr)
    for step in range(1, args.steps + 1):
        x, y = (t.to(device) for t in global_batch(step, args.batch_size))
        losses: list[torch.Tensor] = []  # [PP] the last stage's: one per micro-batch
        # [PP] Every micro-batch through every stage, forward and backward. The first stage gets the inputs, the last
        # the targets; the others call step() empty
        schedule.step(*([x] if first else []), target=y if last else None, losses=losses if last else None)
        # [PP] Clip by the whole model's norm: this stage's sum of squares added over the stages, so every stage
        # scales by the same factor (each stage's own norm would clip each by another)
        norm_sq = torch.nn.utils.get_total_norm([p.grad for p in params]) ** 2
        dist.all_reduce(norm_sq)  # [PP]
        grad_norm = norm_sq.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_GRAD_NORM, grad_norm)
        optimizer.step()
        optimizer.zero_grad()
        if last:  # [PP] the loss exists on the last stage only
            loss, norm = sum(losses).item(), grad_norm.item()
            print(f"step {step} loss {loss:.9f} grad_norm {norm:.9f} accumulated {len(losses)}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="A pipeline in a plain training loop")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, summed over all ranks")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate")
    parser.add_argument("--accum", type=int, default=4, help="micro-batches per step, their gradients accumulated")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if world_size > N_BLOCKS:
        fail(f"{world_size} processes: the model's {N_BLOCKS} blocks make {N_BLOCKS} stages at most; launch fewer")
    if args.accum < world_size or args.batch_size % args.accum:
        fail(
            f"--batch-size {args.batch_size} --accum {args.accum}: 1F1B needs {world_size} micro-batches or more "
            f"(one per stage), each of the same size; use an --accum of {world_size} or more that divides the batch"
        )
    device = setup()
    try:
        train(args, device)
        # The ranks meet once more, and this process keeps the handle until it exits: on gloo, a process whose last
        # collective gloo's thread lets go of during the interpreter's exit aborts (docs/troubleshooting.md)
        LAST_MEETING.append(dist.all_reduce(torch.ones(1, device=device), async_op=True))
        LAST_MEETING[-1].wait()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
