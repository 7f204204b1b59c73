"""Expert parallelism written out (train_ep.py, docs/moe.md): each EP rank holds E / ep of every MoE layer's experts,
and each layer sends every token to the rank that holds its expert with `all_to_all_single`, runs the experts it
holds on what it received, and sends the results back the same way. A file of torch alone: copy it whole."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd  # (backward: the reverse exchange)


class ExpertParallel:
    """An MoE layer's dispatch over `group` (MoE.ep): rank j of the group holds experts j E / ep to (j + 1) E / ep
    - 1, and every rank of the group calls it once per MoE layer in each forward (two all-to-alls and the counts)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group, self.size = group, dist.get_world_size(group)

    def __call__(self, grouped: torch.Tensor, counts: torch.Tensor, experts: nn.Module) -> torch.Tensor:
        """grouped [assignments, D]: this rank's token rows in expert order, counts [E] of them per expert ->
        the experts' outputs for them, in the same order."""
        local = counts.numel() // self.size  # experts per rank
        # 1. the counts first: how many rows each rank will send to each of this rank's experts ([ep, local])
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, local)
        send = counts.view(self.size, local).sum(1).tolist()  # rows to each rank: its experts' counts
        recv = received.sum(1).tolist()  # rows from each rank
        # 2. dispatch: every row to the rank that holds its expert (uneven splits: as the router chose)
        x = exchange(grouped, recv, send, self.group)
        # 3. the rows arrive by source rank, then expert; the experts want them by expert, then source rank
        by_expert = self.regroup(received)
        y = experts(x[by_expert], received.sum(0).tolist())
        y = y[torch.argsort(by_expert)]  # back to the order they came in
        # 4. combine: the outputs back to the ranks their tokens came from (the dispatch reversed)
        return exchange(y, send, recv, self.group)

    @staticmethod
    def regroup(received: torch.Tensor) -> torch.Tensor:
        """The permutation that takes rows ordered by (source rank, expert) to (expert, source rank): received
        [ep, local] is how many rows each source sent each expert."""
        counts = received.tolist()
        starts = torch.tensor([0, *[n for source in counts for n in source]]).cumsum(0).tolist()  # each block's row
        local = len(counts[0])
        blocks = [(starts[s * local + e], counts[s][e]) for e in range(local) for s in range(len(counts))]
        return torch.cat([torch.arange(start, start + n) for start, n in blocks]).to(received.device)


def exchange(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single with autograd: send[j] rows of x to rank j, recv[j] rows from it, in rank order (torch's
    functional collective, as torchtitan's EP: torch.distributed.nn.functional's is deprecated)."""
    out = all_to_all_single_autograd(x.contiguous(), recv, send, group)
    return out.wait() if hasattr(out, "wait") else out  # (an AsyncCollectiveTensor until waited on)
