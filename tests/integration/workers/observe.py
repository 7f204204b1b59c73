"""Probes on a real training, for the tests to see that a feature took effect (tests/integration/workers/runs.py
installs them for a `Run(..., observe=True)`). They only look: global module hooks that read what the layers
compute, and dynamo's own counters; nothing of the training changes.

Per rank, into `<out>.observed/rank<r>.json`:
- "dtypes": the dtypes of what each kind of layer with parameters returned in training (bf16 shows here), and
  "recomputed_dtypes" the same of the forwards recomputed inside backward (activation checkpointing);
- "calls": forward calls of those layers, and how many of them ran inside backward (recomputed: activation
  checkpointing);
- "first_weights": a digest of each layer's parameters at its first forward, as this rank holds them (identical
  initial weights where every rank holds the whole layer);
- "dropout": at the first training forward of a dropout layer, the global RNG's seed and a digest of its mask
  (the scripts re-seed each rank: different masks, same weights);
- "fsdp_offload": whether each FSDP2 parameter is offloaded to the CPU, as FSDP's own state says;
- "dtensor_outputs": of each kind of layer whose output left it a DTensor in training (after the layer's own hooks,
  a TP style's among them: what the next layer or the loss received), each distinct {"local": the shape this rank
  held, "global": the DTensor's, "placements"} (BabyGPT's logits split by vocabulary, its sequence-parallel norms);
- "dynamo": how many Python frames dynamo compiled during the run (--compile), from its own counters.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn


def digest(tensors: list[torch.Tensor]) -> str:
    sha = hashlib.sha256()
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        sha.update(local.detach().float().cpu().clone().numpy().tobytes())  # a copy: numpy pins a storage
    return sha.hexdigest()[:16]


def compiled_frames() -> int:
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


class Observer:
    def __init__(self, *, hooks: bool) -> None:
        self.found: dict[str, Any] = {"dtypes": {}, "calls": {"forward": 0, "recomputed": 0}, "first_weights": {}}
        self.frames_before = compiled_frames()
        self.handles = [nn.modules.module.register_module_forward_hook(self.forward)] if hooks else []
        self.names: dict[int, str] = {}
        self.hooked: set[int] = set()  # the layers whose own hooks end with `returned`

    def forward(self, module: nn.Module, _args: tuple, output: Any) -> None:
        if not module.training:
            return  # evaluation aside
        if isinstance(module, nn.Dropout) and module.p > 0 and "dropout" not in self.found:
            mask = (output == 0) if isinstance(output, torch.Tensor) else None
            self.found["dropout"] = {"seed": torch.initial_seed(), "mask": digest([mask]) if mask is not None else ""}
        state = getattr(module, "_get_fsdp_state", None)
        if state is not None and (group := state()._fsdp_param_group) is not None:
            offload = {bool(p.offload_to_cpu) for p in group.fsdp_params}
            self.found["fsdp_offload"] = sorted(set(self.found.get("fsdp_offload", [])) | offload)
        params = list(module.parameters(recurse=False))
        if not params or list(module.children()):
            return  # a layer of its own: Conv2d, Linear, LayerNorm
        kind = type(module).__name__
        if id(module) not in self.hooked:  # after the layer's own hooks (from its next call on): what it handed on
            self.hooked.add(id(module))
            self.handles.append(module.register_forward_hook(self.returned))
        out = output.to_local() if hasattr(output, "to_local") else output
        inside_backward = torch._C._current_graph_task_id() != -1
        if isinstance(out, torch.Tensor):  # in forward, and in the forwards recomputed inside backward
            dtypes = self.found.setdefault("recomputed_dtypes" if inside_backward else "dtypes", {}).setdefault(
                kind, []
            )
            if str(out.dtype) not in dtypes:
                dtypes.append(str(out.dtype))
        self.found["calls"]["recomputed" if inside_backward else "forward"] += 1
        key = f"{kind}{len(self.found['first_weights'])}"
        if id(module) not in self.names:
            self.names[id(module)] = key
            self.found["first_weights"][key] = digest(params)

    def returned(self, module: nn.Module, _args: tuple, output: Any) -> None:
        if not module.training or torch._C._current_graph_task_id() != -1 or not hasattr(output, "to_local"):
            return  # a DTensor in training forward only
        held = {"local": list(output.to_local().shape), "global": list(output.shape)}
        held["placements"] = [str(p) for p in output.placements]
        if held not in (seen := self.found.setdefault("dtensor_outputs", {}).setdefault(type(module).__name__, [])):
            seen.append(held)

    def close(self, out: str, rank: int) -> None:
        for handle in self.handles:
            handle.remove()
        self.found["dynamo"] = {"frames": compiled_frames() - self.frames_before}
        folder = Path(f"{out}.observed")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"rank{rank}.json").write_text(json.dumps(self.found))
