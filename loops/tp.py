"""Tensor parallelism (TP), and FSDP x TP on a 2-D mesh, in a plain training loop: torch alone, nothing of this suite.

    torchrun --standalone --nproc-per-node 4 loops/tp.py          # 4-way TP: a GPU each + NCCL, else CPU + gloo
    torchrun --standalone --nproc-per-node 4 loops/tp.py --dp 2   # FSDP x TP: 2 replicas x 2-way TP
    python loops/tp.py                                             # 1 process, no torchrun needed

Every linear layer is split over the TP ranks of a replica, which all train on the replica's slice of each global
batch; with --dp, FSDP shards each rank's slices over the replicas. Model, data and seed are every loop's in loops/.
Lines specific to TP are marked `# [TP]`; `apply_tp` is train_tp.py's wrap without its options (docs/copying.md).
"""

import argparse
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

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


def tp_plan() -> dict[str, ParallelStyle]:
    # [TP] Each block's up split by its output features, down by its input features (Megatron's pair): up's slice
    # is down's input, and down's partial outputs are all-reduced. The input layer and the head split by their
    # output features, gathered whole after: every parameter a DTensor (clip_grad_norm_ refuses a mix)
    plan = {f"{i}": ColwiseParallel(output_layouts=Replicate()) for i in (0, N_BLOCKS + 1)}
    for i in range(1, N_BLOCKS + 1):
        plan |= {f"{i}.up": ColwiseParallel(), f"{i}.down": RowwiseParallel()}
    return plan


def apply_tp(
    model: nn.Module, tp_mesh: DeviceMesh, plan: dict, *, dp_mesh: DeviceMesh | None = None, dp_units: list = ()
) -> nn.Module:
    parallelize_module(model, tp_mesh, plan)  # [TP] each layer of the plan split over tp_mesh
    if dp_mesh is not None:  # [TP] FSDP x TP: the replicas shard what TP left each rank, a block at a time
        for unit in dp_units:
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        # FSDP warns that the root's output is a view (the head's gathered logits, to_local()): only an in-place
        # change of it would matter, and none is made
        warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    return model


def train(args: argparse.Namespace, device: torch.device) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    # [TP] A 2-D mesh: "dp" the replicas, "tp" the ranks that split one replica's layers (rank = replica * tp +
    # tp_rank: a replica's TP ranks are neighbours, on one machine where they can be)
    mesh = init_device_mesh(device.type, (args.dp, world_size // args.dp), mesh_dim_names=("dp", "tp"))
    replica, dp_mesh = mesh.get_local_rank("dp"), mesh["dp"] if args.dp > 1 else None
    model = make_model().to(device)
    model = apply_tp(model, mesh["tp"], tp_plan(), dp_mesh=dp_mesh, dp_units=list(model)[1:-1])  # [TP]
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)  # after the wrap: it steps this rank's slices
    for step in range(1, args.steps + 1):
        # [TP] every TP rank of a replica trains on the same samples: the batch is split over the replicas only
        x, y = (t.chunk(args.dp)[replica].to(device) for t in global_batch(step, args.batch_size))
        loss_sum = torch.zeros((), device=device)
        for i, (xc, yc) in enumerate(zip(x.chunk(args.accum), y.chunk(args.accum))):
            if dp_mesh is not None:  # [TP] FSDP x TP: only the last chunk's backward reduce-scatters over "dp"
                model.set_requires_gradient_sync(i == args.accum - 1)
            loss = F.cross_entropy(model(xc), yc) / args.accum  # summed over the chunks: the slice's mean
            loss.backward()
            loss_sum += loss.detach()
        # [TP] The gradients are DTensors: clip_grad_norm_ adds their squares over the mesh dims they are split on
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        grad_norm = grad_norm.full_tensor() if isinstance(grad_norm, DTensor) else grad_norm  # [TP]
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(loss_sum)  # each replica's mean, once per TP rank; / world_size: the global batch's mean
        if rank == 0:
            loss, norm = loss_sum.item() / world_size, grad_norm.item()
            print(f"step {step} loss {loss:.9f} grad_norm {norm:.9f} accumulated {i + 1}", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="TP, and FSDP x TP, in a plain training loop")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, summed over all ranks")
    parser.add_argument("--lr", type=float, default=0.2, help="SGD's learning rate")
    parser.add_argument("--accum", type=int, default=2, help="chunks per replica and step, gradients accumulated")
    parser.add_argument("--dp", type=int, default=1, help="replicas (FSDP x TP), each split over world / dp ranks")
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    dps = [dp for dp in range(1, world_size + 1) if world_size % dp == 0 and N_CLASSES % (world_size // dp) == 0]
    if args.dp not in dps:  # each replica's TP ranks must split every layer evenly, the head's classes too
        fail(
            f"--dp {args.dp}: {world_size} ranks make no {args.dp} replicas of 1, 2, 4 or 8 TP ranks; use --dp in {dps}"
        )
    if args.accum < 1 or args.batch_size % (args.dp * args.accum):
        fail(
            f"--batch-size {args.batch_size} --accum {args.accum}: {args.dp} replicas x {args.accum} chunks do not "
            f"split the batch evenly; use --accum 1 or more and a batch size divisible by {args.dp} x --accum"
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
