"""A mixture of experts (--experts E --top-k k): BabyGPT's MLP replaced by E SwiGLU experts and a router that sends each
token to k of them (docs/moe.md). On one process every expert is here; train_ep.py spreads them over ranks by
setting `MoE.ep` (common/expert_parallel.py), which sends each token to the rank that holds its expert and back.

What makes it comparable across strategies: the balance loss and the capacity are per sequence (DeepSeek-V3's
sequence-wise balance loss), so a rank's share of the batch sees the same routing, drops and loss as one process."""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Experts(nn.Module):
    """E SwiGLU experts, their weights stacked ([E, D, H] gate and up, [E, H, D] down) so that expert parallelism
    splits them by their first dimension. forward(x, counts): x holds counts[0] tokens for the first expert held
    here, then counts[1] for the next..."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = (nn.Parameter(torch.empty(experts, width, hidden)) for _ in range(2))
        self.down = nn.Parameter(torch.empty(experts, hidden, width))

    def forward(self, x: torch.Tensor, counts: Sequence[int]) -> torch.Tensor:
        # under EP the weights are DTensors: this rank computes with its own experts' slice
        gate, up, down = (w.to_local() if hasattr(w, "to_local") else w for w in (self.gate, self.up, self.down))
        outputs = []
        for e, tokens in enumerate(x.split(list(counts))):  # a loop a reader can follow (GPUs: grouped GEMM)
            w_gate, w_up, w_down = gate[e].to(x.dtype), up[e].to(x.dtype), down[e].to(x.dtype)  # (FSDP's bf16)
            outputs.append((F.silu(tokens @ w_gate) * (tokens @ w_up)) @ w_down)
        return torch.cat(outputs) if outputs else x


# (grouped tokens, tokens per expert [E], the experts) -> their outputs, in the same order
Dispatch = Callable[[torch.Tensor, torch.Tensor, Experts], torch.Tensor]


class MoE(nn.Module):
    """A mixture-of-experts MLP for x [B, T, D]: the router scores the E experts for each token (a softmax), each
    token goes to its top k with their scores renormalised to sum to 1 as weights, an optional shared expert sees
    every token. `capacity_factor` > 0 lets each sequence send an expert at most ceil(cf x T x k / E) tokens (the
    rest dropped: they pass through the residual alone); 0 is dropless. After each forward: `aux`, the balance
    loss to add to the model's; `routed` [E], tokens routed to each expert; `dropped`, assignments over capacity."""

    def __init__(
        self, width: int, hidden: int, *, experts: int, top_k: int, shared: bool, capacity_factor: float,
        aux_coef: float, dropout: float,
    ) -> None:  # fmt: skip
        super().__init__()
        self.top_k, self.capacity_factor, self.aux_coef = top_k, capacity_factor, aux_coef
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = Experts(experts, width, hidden)
        self.shared = Experts(1, width, hidden) if shared else None  # an expert that every token runs through
        self.dropout = nn.Dropout(dropout)
        self.ep: Dispatch | None = None  # train_ep.py's ExpertParallel: the experts live on other ranks too
        self.aux, self.routed, self.dropped = torch.zeros(()), torch.zeros(experts, dtype=torch.long), torch.tensor(0)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, D] -> (expert, weight, kept), each [B, T, k]: each token's k experts, their weights, and whether
        the sequence's capacity let the assignment through. Sets `aux`."""
        b, t, _ = x.shape
        experts, k = self.router.out_features, self.top_k
        probs = F.linear(x.float(), self.router.weight.float()).softmax(-1)  # [B, T, E], in fp32 at any precision
        top, expert = probs.topk(k, dim=-1)  # [B, T, k]
        weight = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        chosen = F.one_hot(expert, experts).flatten(1, 2)  # [B, T k, E]: the assignments in token order
        # the balance loss of each sequence: E / (k T) x the tokens it sends each expert, times the mean score it
        # gives it, summed over the experts (1 when balanced); the mean over sequences is a mean over ranks too
        share = chosen.sum(1).float() * experts / (k * t)  # [B, E] (no gradient: the choice is not differentiable)
        self.aux = self.aux_coef * (share * probs.mean(1)).sum(-1).mean()
        kept = torch.ones_like(expert, dtype=torch.bool)
        if self.capacity_factor > 0:  # the first ceil(cf T k / E) assignments of a sequence to an expert go through
            capacity = math.ceil(self.capacity_factor * t * k / experts)
            place = (chosen.cumsum(1) * chosen).sum(-1)  # [B, T k]: 1 for an expert's first token of the sequence
            kept = (place <= capacity).view(b, t, k)
        return expert, weight, kept

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        expert, weight, kept = self.route(x)
        experts, k = self.router.out_features, self.top_k
        self.routed = torch.bincount(expert.flatten(), minlength=experts).detach()
        self.dropped = (~kept).sum().detach()  # (0 when dropless)
        # the kept assignments, grouped by expert (stable: in token order within an expert)
        flat = expert.flatten().masked_fill(~kept.flatten(), experts)  # dropped ones sort last
        order = torch.argsort(flat, stable=True)[: flat.numel() - int(self.dropped)]
        token = order // k  # the token of each assignment
        counts = torch.bincount(flat, minlength=experts + 1)[:experts]
        tokens = x.reshape(-1, d)
        grouped = tokens[token]  # [assignments, D]
        out = self.ep(grouped, counts, self.experts) if self.ep else self.experts(grouped, counts.tolist())
        # each token's output: its experts' outputs weighed by their scores (a dropped assignment adds nothing)
        y = torch.zeros_like(tokens).index_add(0, token, out * weight.flatten()[order, None])
        y = self.dropout(y.view(b, t, d))
        if self.shared is not None:
            y = y + self.dropout(self.shared(tokens, [len(tokens)]).view(b, t, d))
        return y


def aux_loss(moes: Sequence[MoE]) -> torch.Tensor | int:
    """The balance losses of the model's MoE layers (`model.moes()`) from its last forward, to add to its loss."""
    return sum(moe.aux for moe in moes)  # (0 for a dense model)


def routed(moes: Sequence[MoE]) -> torch.Tensor:
    """[layers, E + 1]: the tokens each MoE layer routed to each expert in the last forward, then the assignments
    it dropped over capacity. Read after the forward, before backward recomputes a checkpointed block."""
    return torch.stack([torch.cat([moe.routed, moe.dropped.view(1)]) for moe in moes])


def routing_record(counts: torch.Tensor) -> dict[str, list]:
    """A step's routing over every rank (counts: this rank's `routed`, summed over its accumulation steps), for
    metrics.jsonl: tokens per expert per layer, and the assignments dropped per layer."""
    if dist.is_initialized():
        dist.all_reduce(counts)
    return {"tokens_per_expert": counts[:, :-1].tolist(), "dropped": counts[:, -1].tolist()}
