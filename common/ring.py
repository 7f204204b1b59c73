"""The ring all-reduce, written out: what NCCL and gloo do inside `dist.all_reduce`, in point-to-point sends.

    torchrun --nproc-per-node 4 train_ddp.py --allreduce ring   # DDP's gradient buckets reduced by ring_all_reduce

The n ranks stand in a ring; each cuts the tensor into n chunks. In the reduce-scatter pass (n - 1 steps) every
rank sends one chunk to its right neighbour and adds the chunk arriving from its left into its own copy: after
the pass rank r holds the full sum of chunk (r + 1) % n. In the all-gather pass (n - 1 more steps) the finished
chunks travel round the ring, each overwriting the stale copies. Every rank sends 2 (n - 1) chunks of size 1/n:
2 (n - 1) / n of the tensor, whatever n is (docs/communication.md measures it).
"""

import torch
import torch.distributed as dist


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum `tensor` over the ranks of `group`, in place, by the ring; returns it. Equal to dist.all_reduce(SUM)
    exactly for integers, to rounding for floats (the ring adds the chunks in another order)."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    if n == 1:
        return tensor
    right = dist.get_global_rank(group, (rank + 1) % n) if group else (rank + 1) % n
    left = dist.get_global_rank(group, (rank - 1) % n) if group else (rank - 1) % n
    chunks = torch.tensor_split(tensor.view(-1), n)  # views: n pieces, the first len % n one element longer
    inbox = torch.empty_like(chunks[0])

    def pass_on(send: int, receive: int) -> torch.Tensor:
        """Send chunk `send` to the right while chunk `receive` arrives from the left (into the inbox)."""
        arriving = inbox[: chunks[receive].numel()]
        outgoing = dist.isend(chunks[send], right, group=group)  # non-blocking: every rank sends before it waits
        dist.recv(arriving, left, group=group)
        outgoing.wait()
        return arriving

    for step in range(n - 1):  # reduce-scatter: add what arrives into our copy of that chunk
        receive = (rank - step - 1) % n
        chunks[receive].add_(pass_on((rank - step) % n, receive))
    for step in range(n - 1):  # all-gather: the finished chunks replace the stale copies
        receive = (rank - step) % n
        chunks[receive].copy_(pass_on((rank + 1 - step) % n, receive))
    return tensor


# (no `from __future__ import annotations` here: DDP reads the hook's annotations and wants the GradBucket class)
def ring_hook(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook (`model.register_comm_hook(None, ring_hook)`): each gradient bucket averaged over
    the ranks by ring_all_reduce instead of DDP's built-in all-reduce, as DDP's own hook does (divide, then sum)."""
    tensor = bucket.buffer().div_(dist.get_world_size(group))
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(ring_all_reduce(tensor, group))  # done when this returns: the ring blocks until it is
    return future
