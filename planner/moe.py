"""The planner for a mixture of experts (a --model-size with experts: Mixtral 8x7B, 8x22B, the DeepSeek-V3-shaped
one): FSDP alone against train_ep.py's EP x FSDP, per rank and per step, counted from the shape.

Not measured on fake tensors as the dense plans are: an MoE layer's routing is data dependent (MoE.forward reads
the counts of tokens per expert, counts.tolist(), which a fake tensor has not), so the routing is planned as
balanced: every expert gets tokens x k / E of each rank's tokens. Then the compute is the same under both (each
rank's tokens run through k experts' worth of FLOPs, wherever the experts are), and what differs is what is planned
here:

- **state per rank** (AdamW, fp32: 16 bytes per parameter: the weight, its gradient, two moments): the same under
  both, every parameter sharded over the world. FSDP alone shards each block whole; EP x FSDP (train_ep.py's
  apply_ep, torchtitan's dp2ep) splits each layer's routed experts by expert over ep ranks and makes them an FSDP unit
  of their own over "dp" (the world / ep ranks ep apart that hold the same slice), and shards the rest (attention,
  norms, router, shared expert, embedding, head) over the world with a unit per block (apply_fsdp);
- **FSDP's units held whole**: the largest that runs at once, parameters and gradients: a block (under EP its dense
  part and, where dp > 1, its E / ep experts gathered over "dp"), or the root's embedding and output layer;
- **communication per step**: FSDP's all-gathers (forward and backward) and reduce-scatters of what it shards over
  the world (FSDP alone: whole blocks, every expert in them; EP: the dense parts); under EP with dp > 1 each layer's
  E / ep experts all-gathered over "dp" for forward and again for backward (reshard_after_forward) and their
  gradients reduce-scattered there (fp32), with ep = world (dp = 1) the experts never move; and the all-to-alls, 2
  per MoE layer forward (dispatch, combine) and 2 backward, each of tokens x k rows x width, of which each rank
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
    def dp(self) -> int:
        """Under EP the ranks that hold the same slice of the experts and shard it (mesh["dp"]): world / ep."""
        return self.world_size // self.ep if self.ep else 0

    @property
    def experts_per_rank(self) -> float:
        """Routed experts of each layer a rank runs, gathered whole for it: every one under FSDP alone, E / ep under
        EP (their state is 1 / world of them under both)."""
        return self.shape.experts / (self.ep or 1)

    @property
    def params_per_rank(self) -> float:
        """Every parameter sharded over the world: under EP the experts over "ep" and "dp", the rest over all ranks."""
        return (self.expert_params + self.dense_params) / self.world_size

    @property
    def state_bytes(self) -> float:
        return STATE_BYTES * self.params_per_rank

    @property
    def unit_bytes(self) -> int:
        """FSDP's units held whole at once, their parameters (in the run's dtype) and their fp32 gradients: a block
        (under EP its dense part, and its experts' unit where dp > 1), or the root's embedding and output layer,
        whichever is larger."""
        return max(self._block() + self._experts_gathered(), self._root()) * (DTYPE_BYTES[self.precision] + 4)

    def _block(self) -> int:
        """A block's parameters that FSDP shards over the world: all of them, or under EP all but its routed
        experts."""
        shape = self.shape
        block = (gpt_parameters(shape, shape.vocab) - self._root()) // shape.depth
        return block - (expert_parameters(shape._replace(shared=False)) if self.ep else 0)

    def _experts_gathered(self) -> int:
        """Under EP, a layer's experts unit gathered over "dp": its E / ep experts whole; none where dp is 1 (the
        rank's slice is whole already) and none under FSDP alone (the experts are in the block)."""
        if not self.ep or self.dp == 1:
            return 0
        return expert_parameters(self.shape._replace(shared=False)) // self.ep

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
        """(a collective, how many a step) of this rank: FSDP's per unit over the world, the experts' over "dp",
        the all-to-alls over "ep"."""
        shape, n, dtype = self.shape, self.world_size, DTYPE_BYTES[self.precision]
        block, root, experts = self._block(), self._root(), self._experts_gathered()
        out: list[tuple[Collective, int]] = []
        if n > 1:  # a unit per block: gathered for forward and again for backward, its gradients reduce-scattered;
            # the root gathered once (it stays gathered from forward to backward) and its gradients reduce-scattered
            out += [(Collective("all_gather", n, block * dtype, "forward"), 2 * shape.depth)]
            out += [(Collective("reduce_scatter", n, block * 4, "backward"), shape.depth)]
            out += [(Collective("all_gather", n, root * dtype, "forward"), 1)]
            out += [(Collective("reduce_scatter", n, root * 4, "backward"), 1)]
        if experts:  # each layer's experts unit over "dp", ranks ep apart (train_ep.py's mesh ("dp", "ep")): the
            # same twice a step as a block's, the gradients in fp32 (apply_ep's reduce_dtype)
            dp, apart = self.dp, (0, self.ep)
            out += [(Collective("all_gather", dp, experts * dtype, "forward", first_and_stride=apart), 2 * shape.depth)]
            out += [(Collective("reduce_scatter", dp, experts * 4, "backward", first_and_stride=apart), shape.depth)]
        if self.all_to_alls:  # the ep ranks of a group are neighbours: one node's links where ep fits in one
            out += [(Collective("all_to_all", self.ep, self.all_to_all_bytes, "forward"), self.all_to_alls)]
        return out

    def times(self, profile: Profile) -> dict[str, float]:
        """Seconds a step spends on `profile` (a GPU's: its links), not overlapped, in "all_to_all" (the tokens',
        over "ep"), "fsdp" (the all-gathers and reduce-scatters over the world) and "experts" (the experts' over
        "dp", EP only)."""
        spent = {"all_to_all": 0.0, "fsdp": 0.0, "experts": 0.0}
        for c, calls in self.collectives():
            part = "all_to_all" if c.kind == "all_to_all" else "experts" if c.first_and_stride[1] > 1 else "fsdp"
            spent[part] += calls * profile.collective_time(c)
        return spent


def moe_plans(size: str, world_sizes: list[int], *, tokens: int, precision: str = "fp32") -> list[MoePlan]:
    """FSDP alone and EP x FSDP at each world size: EP over the largest ep that divides both the experts and the
    world (train_ep.py's --ep; 8 experts on 64 ranks: 8, and their FSDP over the 8 ranks 8 apart)."""
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
        "| strategy | ranks | experts run per rank (of each layer) | params per rank | state per rank | units held "
        "whole | all-to-alls per step | all-to-all size |"
        + (" all-to-all time | FSDP time (world) | experts' FSDP time (dp) | collectives in all |" if profile else ""),
        "|---|---|---|---|---|---|---|---|" + ("---|---|---|---|" if profile else ""),
    ]
    for p in plans:
        row = (
            f"| {p.name} | {p.world_size:,} | {p.experts_per_rank:g} | {p.params_per_rank / 1e9:.3f} B | "
            f"{_gb(p.state_bytes)} | {_gb(p.unit_bytes)} | {p.all_to_alls} | {_gb(p.all_to_all_bytes)} |"
        )
        if profile:
            t = p.times(profile)
            row += "".join(f" {t[part] * 1e3:.1f} ms |" for part in ("all_to_all", "fsdp", "experts"))
            row += f" {sum(t.values()) * 1e3:.1f} ms |"
        lines.append(row)
    if profile:
        lines += ["", f"(times on {profile.name}: each collective's bytes at its link's bus bandwidth, not overlapped)"]
    return "\n".join(lines)
