"""The planner for a mixture of experts (a --model-size with experts: Mixtral 8x7B, 8x22B, the DeepSeek-V3-shaped
one): FSDP alone against train_ep.py's EP x FSDP, per rank and per step, counted from the shape.

Not measured on fake tensors as the dense plans are: an MoE layer's routing is data dependent (MoE.forward reads
the counts of tokens per expert, counts.tolist(), which a fake tensor has not), so the routing is planned as
balanced: every expert gets tokens x k / E of each rank's tokens. Then the compute is the same under both (each
rank's tokens run through k experts' worth of FLOPs, wherever the experts are), and what differs is what is planned
here:

- **state per rank** (AdamW, fp32: 16 bytes per parameter: the weight, its gradient, two moments): FSDP alone
  shards every parameter over the world; EP x FSDP keeps E / ep routed experts of every layer on each rank (each
  group of ep ranks one copy: world / ep copies) and shards the rest (attention, norms, router, shared expert,
  embedding, head) over the world, as train_ep.py's apply_ep and apply_fsdp do;
- **FSDP's unit held whole**: the largest unit's parameters and gradients while it runs (a block; under EP its
  dense part);
- **communication per step**: FSDP's all-gathers (forward and backward) and reduce-scatter of what it shards, over
  the world; EP's expert gradients all-reduced over the world / ep copies (reduce_expert_grads); and the all-to-alls,
  2 per MoE layer forward (dispatch, combine) and 2 backward, each of tokens x k rows x width, of which each rank
  sends (ep - 1) / ep away. Each timed as planner/timing.py times a collective on a GPU profile: its bytes at the
  link's bus bandwidth (NVLink within a node, the network across), plus its latency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.gpt_sizes import GPT_SIZES, GptShape, expert_parameters, gpt_parameters
from planner.count import Collective
from planner.timing import Profile

STATE_BYTES = 16  # per parameter: fp32 weight, gradient, AdamW's two moments (the textbook's)
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}  # the activations the all-to-alls move, FSDP's gathered weights


@dataclass(frozen=True)
class MoePlan:
    """One strategy at one world size: `ep` 0 is FSDP alone, else EP over ep ranks x FSDP over the world."""

    size: str
    world_size: int
    ep: int
    tokens: int  # per rank per step (sequences x tokens each)
    precision: str = "fp32"

    @property
    def shape(self) -> GptShape:
        return GPT_SIZES[self.size]

    @property
    def name(self) -> str:
        return f"ep {self.ep} x fsdp" if self.ep else "fsdp"

    @property
    def expert_params(self) -> int:
        """Every layer's routed experts, all of them (the shared expert is FSDP's under EP too: train_ep.py)."""
        return self.shape.depth * expert_parameters(self.shape._replace(shared=False))

    @property
    def dense_params(self) -> int:
        return gpt_parameters(self.shape, self.shape.vocab) - self.expert_params

    @property
    def experts_per_rank(self) -> float:
        """Routed experts of each layer whose state this rank holds (FSDP alone: 1 / world of each)."""
        return self.shape.experts / (self.ep or self.world_size)

    @property
    def params_per_rank(self) -> float:
        if not self.ep:
            return (self.expert_params + self.dense_params) / self.world_size
        return self.expert_params / self.ep + self.dense_params / self.world_size

    @property
    def state_bytes(self) -> float:
        return STATE_BYTES * self.params_per_rank

    @property
    def unit_bytes(self) -> int:
        """FSDP's largest unit held whole, its parameters (in the run's dtype) and their fp32 gradients: a block, or
        the root's embedding and output layer, whichever is larger."""
        return max(self._block(), self._root()) * (DTYPE_BYTES[self.precision] + 4)

    def _block(self) -> int:
        """A block's parameters that FSDP shards: all of them, or under EP all but its routed experts."""
        shape = self.shape
        block = (gpt_parameters(shape, shape.vocab) - self._root()) // shape.depth
        return block - (expert_parameters(shape._replace(shared=False)) if self.ep else 0)

    def _root(self) -> int:
        """FSDP's root unit: the embedding, the final norm, the output layer."""
        return 2 * self.shape.vocab * self.shape.width + self.shape.width

    @property
    def all_to_all_bytes(self) -> int:
        """One exchange's size on a rank (nccl-tests' size): its tokens x k rows of width values. (ep - 1) / ep of
        it leaves the rank."""
        return self.tokens * self.shape.top_k * self.shape.width * DTYPE_BYTES[self.precision] if self.ep > 1 else 0

    @property
    def all_to_alls(self) -> int:
        """Per step: 2 per MoE layer forward (dispatch, combine), 2 backward (their gradients)."""
        return 4 * self.shape.depth if self.ep > 1 else 0

    def collectives(self) -> list[tuple[Collective, int]]:
        """(a collective, how many a step) of this rank: FSDP's per unit, the experts' all-reduce, the all-to-alls."""
        shape, n, dtype = self.shape, self.world_size, DTYPE_BYTES[self.precision]
        block, root = self._block(), self._root()
        out: list[tuple[Collective, int]] = []
        if n > 1:  # a unit per block: gathered for forward and again for backward, its gradients reduce-scattered;
            # the root gathered once (it stays gathered from forward to backward) and its gradients reduce-scattered
            out += [(Collective("all_gather", n, block * dtype, "forward"), 2 * shape.depth)]
            out += [(Collective("reduce_scatter", n, block * 4, "backward"), shape.depth)]
            out += [(Collective("all_gather", n, root * dtype, "forward"), 1)]
            out += [(Collective("reduce_scatter", n, root * 4, "backward"), 1)]
        copies = n // self.ep if self.ep else 1
        if copies > 1:  # the experts' gradients over the copies: ranks ep apart (train_ep.py's mesh ("dp", "ep"))
            grads = self.expert_params // self.ep * 4
            out += [(Collective("all_reduce", copies, grads, "backward", first_and_stride=(0, self.ep)), 1)]
        if self.all_to_alls:  # the ep ranks of a group are neighbours: one node's links where ep fits in one
            out += [(Collective("all_to_all", self.ep, self.all_to_all_bytes, "forward"), self.all_to_alls)]
        return out

    def times(self, profile: Profile) -> dict[str, float]:
        """Seconds a step spends in each kind of collective on `profile` (a GPU's: its links), not overlapped."""
        spent: dict[str, float] = {}
        for c, calls in self.collectives():
            spent[c.kind] = spent.get(c.kind, 0.0) + calls * profile.collective_time(c)
        return spent


def moe_plans(size: str, world_sizes: list[int], *, tokens: int, precision: str = "fp32") -> list[MoePlan]:
    """FSDP alone and EP x FSDP at each world size: EP over the largest ep that divides both the experts and the
    world (train_ep.py's --ep; 8 experts on 64 ranks: 8, 8 copies of them)."""
    experts = GPT_SIZES[size].experts
    plans = []
    for n in world_sizes:
        plans.append(MoePlan(size, n, 0, tokens, precision))
        if (ep := math.gcd(experts, n)) > 1:
            plans.append(MoePlan(size, n, ep, tokens, precision))
    return plans


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e7 else f"{n / 1e6:.3f} MB"


def moe_table(plans: list[MoePlan], profile: Profile | None) -> str:
    p = plans[0]
    shape = p.shape
    lines = [
        f"BabyGPT {p.size}: {gpt_parameters(shape, shape.vocab):,} parameters, {shape.depth} MoE layers of "
        f"{shape.experts} experts ({shape.top_k} per token{', + 1 shared' if shape.shared else ''}); "
        f"{p.tokens:,} tokens per rank, {p.precision}; routing planned as balanced (tokens x k / E per expert). "
        "state: AdamW, 16 bytes per parameter.",
        "",
        "| strategy | ranks | experts per rank (of each layer) | params per rank | state per rank | unit held whole "
        "| all-to-alls per step | all-to-all size |"
        + (" all-to-all time | FSDP + expert grads time |" if profile else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|" if profile else ""),
    ]
    for p in plans:
        row = (
            f"| {p.name} | {p.world_size:,} | {p.experts_per_rank:g} | {p.params_per_rank / 1e9:.3f} B | "
            f"{_gb(p.state_bytes)} | {_gb(p.unit_bytes)} | {p.all_to_alls} | {_gb(p.all_to_all_bytes)} |"
        )
        if profile:
            t = p.times(profile)
            rest = sum(s for kind, s in t.items() if kind != "all_to_all")
            row += f" {t.get('all_to_all', 0.0) * 1e3:.1f} ms | {rest * 1e3:.1f} ms |"
        lines.append(row)
    if profile:
        lines += ["", f"(times on {profile.name}: each collective's bytes at its link's bus bandwidth, not overlapped)"]
    return "\n".join(lines)
