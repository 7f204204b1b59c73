"""Run under torchrun: checks the seeding contract of the scripts on real ranks.

Every rank builds the model as the scripts do, then re-seeds with seed + rank as they do; the weights must
be identical on all ranks and the dropout masks must differ. Exits non-zero (with a message) otherwise.
"""

import torch
import torch.distributed as dist

from common.distributed import seed_everything, setup_distributed, teardown_distributed
from common.model import build_model


def main() -> None:
    env = setup_distributed(timeout_s=60)
    try:
        model = build_model(seed=0, in_channels=1, image_size=28, num_classes=10, dropout=0.5)
        seed_everything(0 + env.rank)
        mask = model.dropout(torch.ones(4096)) != 0
        weights = torch.cat([p.detach().flatten() for p in model.parameters()])
        masks = [torch.empty_like(mask) for _ in range(env.world_size)]
        all_weights = [torch.empty_like(weights) for _ in range(env.world_size)]
        dist.all_gather(masks, mask)
        dist.all_gather(all_weights, weights)
        if env.rank == 0:
            assert all(torch.equal(all_weights[0], w) for w in all_weights), "initial weights differ across ranks"
            assert len({m.numpy().tobytes() for m in masks}) == env.world_size, "dropout masks repeat across ranks"
            print(f"seeding ok on {env.world_size} ranks")
    finally:
        teardown_distributed()


if __name__ == "__main__":
    main()
