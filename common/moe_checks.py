"""What a mixture of experts (--experts) and expert parallelism (train_ep.py) need of their flags, checked before
torchrun by the runners' preflight and again by the workers (Config.check). No torch here."""

from __future__ import annotations

from typing import Any

from common.errors import ConfigError

MOE_STRATEGIES = ("ddp", "fsdp", "ep")  # the scripts that train a mixture of experts


def check_moe(cfg: Any, *, world_size: int | None) -> None:
    """ConfigError unless cfg's MoE flags can run: --top-k, --shared-expert, --capacity-factor and --aux-loss-coef only
    with --experts, k <= E, a script that trains experts, and for train_ep.py an --ep that divides the world size and
    the experts."""
    given = [f for f in ("top_k", "shared_expert", "capacity_factor") if getattr(cfg, f)]
    given += ["aux_loss_coef"] if cfg.aux_loss_coef != 0.01 else []
    if not cfg.experts:
        if cfg.strategy == "ep":
            raise ConfigError(
                "--experts: expert parallelism spreads a mixture of experts over the ranks, and this BabyGPT is dense; "
                "give --experts E (e.g. --experts 8), or train a dense model with train_fsdp.py"
            )
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise ConfigError(f"{flag}: a flag of the mixture of experts, and this model is dense: add --experts E")
        return
    if cfg.top_k > cfg.experts:
        raise ConfigError(f"--top-k: {cfg.top_k} experts per token, of --experts {cfg.experts}; use 1 to {cfg.experts}")
    if not 0 <= cfg.capacity_factor < float("inf"):
        raise ConfigError(f"--capacity-factor: must be 0 (dropless) or positive, got {cfg.capacity_factor}")
    if not 0 <= cfg.aux_loss_coef < float("inf"):
        raise ConfigError(f"--aux-loss-coef: must be 0 (no balance loss) or positive, got {cfg.aux_loss_coef}")
    if cfg.strategy not in MOE_STRATEGIES:
        raise ConfigError(
            f"--experts: train_{cfg.strategy}.py does not split a mixture of experts (its experts would need "
            f"their own split); train it with train_ddp.py, train_fsdp.py or train_ep.py"
        )
    if cfg.strategy == "ep" and world_size is not None:
        ep = cfg.ep or world_size
        if world_size % ep:
            raise ConfigError(f"--ep: {ep} EP ranks do not divide the world size {world_size}; use a divisor of it")
        if cfg.experts % ep:
            fits = ", ".join(str(n) for n in range(1, world_size + 1) if world_size % n == 0 and cfg.experts % n == 0)
            raise ConfigError(
                f"--experts: {cfg.experts} experts do not spread evenly over {ep} EP ranks; use a multiple of {ep} "
                f"experts, or --ep {fits}"
            )
