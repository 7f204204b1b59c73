"""Data parallelism (DDP) in a plain training loop: torch alone, nothing of this suite.

    torchrun --standalone --nproc-per-node 4 loops/ddp.py   # 4 processes: a GPU each + NCCL, else CPU + gloo
    python loops/ddp.py                                      # 1 process, no torchrun needed

Every rank holds the whole model and trains on its slice of each global batch; backward all-reduces the gradients,
so every rank takes the same step. Model, data and seed are those of every loop in loops/: all print the same losses.
Lines specific to DDP are marked `# [DDP]`; `apply_ddp` is train_ddp.py's wrap without its options (docs/copying.md).
"""

import argparse
import os
import sys
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

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


def apply_ddp(model: nn.Module, *, device_ids: list[int] | None = None) -> nn.Module:
    # [DDP] Hooks all-reduce the gradients during backward, bucket by bucket; rank 0's weights are broadcast here
    return DDP(model, device_ids=device_ids)


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device_ids = [device.index] if device.type == "cuda" else None  # [DDP] this process's one GPU
    model = apply_ddp(make_model().to(device), device_ids=device_ids)  # [DDP]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    for step in range(1, args.steps + 1):
        x, y = (t.chunk(world_size)[rank].to(device) for t in global_batch(step, args.batch_size))  # [DDP] my slice
        loss_sum = torch.zeros((), device=device)
        for i, (xc, yc) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            # [DDP] Gradients accumulate locally in all but the last chunk; its backward all-reduces their sum, once
            with nullcontext() if i == args.accum - 1 else model.no_sync():
                loss = F.cross_entropy(model(xc), yc) / args.accum  # summed over the chunks: the slice's mean
                loss.backward()
            loss_sum += loss.detach()
        # [DDP] Every rank holds the whole, all-reduced gradient: its own norm is the model's, no collective needed
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)  # the ranks' means added up; / world_size: the mean over the global batch
        if rank == 0:
            loss, norm = loss_sum.item() / world_size, grad_norm.item()
            print(f"step {step} loss {loss:.9f} grad_norm {norm:.9f} accumulated {i + 1}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="DDP in a plain training loop")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, summed over all ranks")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate")
    parser.add_argument("--accum", type=int, default=2, help="chunks per rank and step, their gradients accumulated")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.accum < 1 or args.batch_size % (world_size * args.accum):
        fail(
            f"--batch-size {args.batch_size} --accum {args.accum}: {world_size} ranks x {args.accum} chunks do not "
            f"split the batch evenly; use --accum 1 or more and a batch size divisible by {world_size} x --accum"
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
