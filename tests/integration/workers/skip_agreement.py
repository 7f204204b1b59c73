"""fp16's skip decision, checked on real ranks (tests/integration/workers/runs.py calls it).

An overflow (an inf) is put into ONE rank's gradients only: a shard of an FSDP2-sharded layer on rank 2, then a
parameter that only rank 3 holds (as a pipeline stage does). clip_grad_norm's global norm must be inf on every
rank, so that every LossScaler skips and halves its scale together. torch.amp.GradScaler's own check is asked
too: on FSDP2's DTensor gradients it agrees (DTensor reduces its inf flag over the mesh), on a pipeline's plain
tensors each rank sees only its own stage. Rank 0 writes the decisions to out/skip_agreement.json.
"""

import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from common.cli import parse_config
from common.clipping import clip_grad_norm
from common.training import loss_scaler


def gathered(value: float) -> list[float]:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return values


def decisions(cfg, params, *, groups) -> dict[str, list]:
    """What the scripts do: the global norm (unscaled), then LossScaler.step; every rank's decision and scale."""
    scaler = loss_scaler(cfg)
    scaler.step(None, clip_grad_norm(params, 1.0, groups=groups, loss_scale=scaler.value))
    return {"skipped": gathered(scaler.skipped), "scale": gathered(scaler.value)}


def gradscaler_found_inf(params) -> list[float]:
    """torch.amp.GradScaler's inf check (unscale_), on each rank."""
    optimizer = torch.optim.SGD(list(params), lr=0.1)
    grad_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    grad_scaler.scale(torch.ones(()))  # (GradScaler makes its scale tensor at the first call)
    grad_scaler.unscale_(optimizer)
    state = grad_scaler._per_optimizer_states[id(optimizer)]  # (private: the flag its step() reads)
    return gathered(sum(v.item() for v in state["found_inf_per_device"].values()))


def check_skip_agreement(env, out: Path) -> None:
    cfg = parse_config("fsdp", ["--precision", "fp16", "--loss-scale", "1024"])
    found = {}
    # 1. FSDP2: every rank holds a shard of the layer's gradient; only rank 2's shard overflowed
    layer = torch.nn.Linear(16, 8)
    fully_shard(layer, mesh=init_device_mesh("cpu", (env.world_size,)))
    layer(torch.ones(4, 16)).sum().mul(1024.0).backward()
    local = layer.weight.grad.to_local()
    if env.rank == 2:
        local[0, 0] = float("inf")
    saved = [p.grad.to_local().clone() for p in layer.parameters()]
    found["fsdp"] = decisions(cfg, layer.parameters(), groups=[])
    for p, grad in zip(layer.parameters(), saved):
        p.grad.to_local().copy_(grad)
    found["fsdp"]["gradscaler"] = gradscaler_found_inf(layer.parameters())
    # 2. A pipeline: each rank its own parameters (a stage); only rank 3's overflowed
    stage = torch.nn.Parameter(torch.zeros(5))
    stage.grad = torch.full((5,), float("inf") if env.rank == 3 else 1024.0)
    found["pipeline"] = {**decisions(cfg, [stage], groups=[dist.group.WORLD]), "gradscaler": None}
    stage.grad = torch.full((5,), float("inf") if env.rank == 3 else 1024.0)
    found["pipeline"]["gradscaler"] = gradscaler_found_inf([stage])
    if env.rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "skip_agreement.json").write_text(json.dumps(found))
