"""What a strategy's layout needs of the world size and the model's shape, as the scripts check it when they start:
checked before torchrun (runner/preflight.py) and for every alternative the memory wall or the planner names."""

from __future__ import annotations

from dataclasses import replace

from common.config import Config
from common.errors import ConfigError
from common.model_sizes import DATASET_SHAPES, check_tp, check_vit, input_shape, max_stages
from common.pipeline_layout import PipelineLayout


def check_layout(cfg: Config, world_size: int, *, planned: bool = False) -> None:
    """What the pipeline's and TP's layouts need of the world size, as train_pippy.py and train_tp.py check it,
    and what the ViT's shape allows: on the data set's images, or (`planned`) on those python -m planner plans the
    size for (the published ViTs': 224 x 224)."""
    if cfg.strategy == "pippy":
        PipelineLayout.of(cfg, world_size).check(chunk_size=cfg.chunk_size(world_size), compile=cfg.compile)
    if cfg.strategy == "tp" or cfg.tp > 1:
        check_tp(cfg, world_size)
    if cfg.model == "vit":  # what the ViT's shape allows, as BabyViT checks it when it is built
        side = input_shape(cfg.model, cfg.model_size, cfg.dataset)[1] if planned else DATASET_SHAPES[cfg.dataset][1]
        check_vit(cfg.model_size, side, patch=cfg.patch_size, heads=cfg.heads)


def would_start(cfg: Config, world_size: int, *, planned: bool = False) -> bool:
    """Whether the scripts would start `cfg` on `world_size` ranks (`planned`: on the images the planner plans it
    for): its flags' checks and its layout's (a ValueError: more pipeline stages than the model has layers to cut)."""
    try:
        replace(cfg).check(world_size=world_size)  # (a copy: check settles some fields)
        check_layout(cfg, world_size, planned=planned)
    except (ConfigError, ValueError):
        return False
    return True


def pipeline_replicas(cfg: Config, nproc: int) -> int:
    """The fewest data-parallel replicas (--dp) that cut `nproc` ranks into pipelines no longer than the model has
    blocks to cut (BabyGPT baby's 2): run_all.sh's pipeline when its flags give no --dp."""
    stages = max_stages(cfg.model_size, cfg.model) // cfg.stages_per_rank
    return next((dp for dp in range(1, nproc + 1) if nproc % dp == 0 and nproc // dp <= stages), 1)


if __name__ == "__main__":  # run_all.sh: `python -m runner.layout NPROC FLAGS...` prints the pipeline's --dp
    import sys  # and the model (BabyGPT's runs add context parallelism)

    from common.cli import parse_config

    dp, model = 1, "cnn"  # with a --dp of yours, or flags run_pippy.sh refuses (it says so in one line)
    if not any(flag == "--dp" or flag.startswith("--dp=") for flag in sys.argv[2:]):
        try:
            dp = pipeline_replicas(parse_config("pippy", sys.argv[2:]), int(sys.argv[1]))
        except (ConfigError, SystemExit, ValueError):
            pass
    try:
        model = parse_config("ddp", sys.argv[2:]).model
    except (ConfigError, SystemExit):
        pass
    print(dp, model)
