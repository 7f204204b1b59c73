"""The seeding contract of the scripts, checked on real ranks (tests/integration/workers/runs.py calls it).

Every rank builds the model as the scripts do, then re-seeds with seed + rank as they do; the weights must
be identical on all ranks and the dropout masks must differ. Rank 0 writes what it found to out/seeding.txt.
"""

from pathlib import Path

import torch
import torch.distributed as dist

from common.distributed import seed_everything
from common.model import build_model


def check_seeding(env, out: Path) -> None:
    model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.5)
    seed_everything(0 + env.rank)
    mask = model.dropout(torch.ones(4096)) != 0
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    masks = [torch.empty_like(mask) for _ in range(env.world_size)]
    all_weights = [torch.empty_like(weights) for _ in range(env.world_size)]
    dist.all_gather(masks, mask)
    dist.all_gather(all_weights, weights)
    if env.rank == 0:
        same_weights = all(torch.equal(all_weights[0], w) for w in all_weights)
        distinct_masks = len({m.numpy().tobytes() for m in masks})
        out.mkdir(parents=True, exist_ok=True)
        found = [f"ranks {env.world_size}", f"identical initial weights {same_weights}"]
        (out / "seeding.txt").write_text("\n".join([*found, f"distinct dropout masks {distinct_masks}"]) + "\n")
