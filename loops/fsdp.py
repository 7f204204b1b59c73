"""Fully sharded data parallelism (FSDP2's `fully_shard`) in a plain training loop: torch alone, nothing of this suite.

    torchrun --standalone --nproc-per-node 4 loops/fsdp.py          # 4 processes: a GPU each + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 loops/fsdp.py --dp 2   # HSDP: 2 replicas, each sharded over 2 ranks
    python loops/fsdp.py                                             # 1 process, no torchrun needed

Every rank holds a shard of each parameter, gradient and optimizer state and trains on its slice of each global batch;
a block's shards are all-gathered before it runs, its gradients reduce-scattered after its backward. Model, data and
seed are those of every loop in loops/: all print the same losses. Lines specific to FSDP are marked `# [FSDP]`;
`apply_fsdp` is train_fsdp.py's wrap without its options (docs/copying.md).
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

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


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, *, units: list[nn.Module]) -> nn.Module:
    # [FSDP] Each unit: an all-gather before its forward and its backward, a reduce-scatter after its backward; the
    # root takes the layers no unit holds. Every parameter becomes a DTensor, sharded on dim 0 over the mesh.
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # [FSDP] Shards over "shard"; with --dp (HSDP) the "replicate" rows hold the same shards and all-reduce them
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=("replicate", "shard"))
    model = make_model()  # [FSDP] built on the CPU: fully_shard moves this rank's shards to the mesh's device
    model = apply_fsdp(model, mesh, units=list(model)[1:-1])  # [FSDP] a unit per block
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # [FSDP] after the wrap: it steps the shards
    for step in range(1, args.steps + 1):
        x, y = (t.chunk(world_size)[rank].to(device) for t in global_batch(step, args.batch_size))  # my slice
        loss_sum = torch.zeros((), device=device)
        for i, (xc, yc) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            # [FSDP] Gradients accumulate unsharded in all but the last chunk; its backward reduce-scatters their sum
            model.set_requires_gradient_sync(i == args.accum - 1)
            loss = F.cross_entropy(model(xc), yc) / args.accum  # summed over the chunks: the slice's mean
            loss.backward()
            loss_sum += loss.detach()
        # [FSDP] The gradients are DTensor shards: clip_grad_norm_ adds their squares over "shard" (not "replicate",
        # whose rows hold copies): the whole model's norm, the same on every rank
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm  # [FSDP]
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)  # the ranks' means added up; / world_size: the mean over the global batch
        if rank == 0:
            loss, norm = loss_sum.item() / world_size, grad_norm.item()
            print(f"step {step} loss {loss:.9f} grad_norm {norm:.9f} accumulated {i + 1}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="FSDP2 in a plain training loop")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, summed over all ranks")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate")
    parser.add_argument("--accum", type=int, default=2, help="chunks per rank and step, their gradients accumulated")
    parser.add_argument("--dp", type=int, default=1, help="replicas (HSDP), each sharding the model over its ranks")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    if args.dp < 1 or world_size % args.dp:
        fail(f"--dp {args.dp}: {world_size} ranks do not make {args.dp} equal replicas; use a divisor of {world_size}")
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
