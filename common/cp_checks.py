"""What context parallelism (train_cp.py) needs of its flags, checked before torchrun by the runners' preflight and
again by the workers (Config.check). No torch here."""

from __future__ import annotations

from common.errors import ConfigError


def check_cp(
    model: str, *, seq_len: int, compile: bool, cp_attention: str, device: str, dp: int, tp: int, world_size: int | None
) -> None:
    """ConfigError unless these flags can run as CP: BabyGPT (causal attention over tokens), no --compile,
    --cp-attention torch only on CUDA (`device`: cpu or cuda where known, else --device), and with `world_size`, a
    --seq-len that cuts into a head and a tail chunk per CP rank."""
    if model != "gpt":
        why = (
            "BabyCNN has no tokens or attention"
            if model == "cnn"
            else "the ViT's attention is bidirectional, over 17 patches, and the ring's head and tail chunks balance "
            "a causal mask, so it is refused"
        )
        raise ConfigError(
            f"--model: context parallelism splits a sequence's tokens and runs causal attention as a "
            f"ring; {why}: use --model gpt (train_cp.py's default)"
        )
    if tp > 1:
        raise ConfigError(
            "--tp: train_cp.py composes CP with FSDP only; CP x TP (torchtitan's 4-D mesh) is sound but not built "
            "here: for TP use train_tp.py, or train_pippy.py --tp"
        )
    if compile:
        raise ConfigError(
            "--compile: the ring sends from Python inside an autograd.Function, which torch.compile would break at; "
            "drop --compile"
        )
    if cp_attention == "torch" and device == "cpu":
        raise ConfigError(
            "--cp-attention: torch's context_parallel runs only CUDA's attention kernels; on CPU use ring (the default)"
        )
    if world_size is not None and seq_len % (2 * (cp := world_size // dp)):
        raise ConfigError(
            f"--seq-len: {seq_len} tokens do not cut into 2 x {cp} CP ranks = {2 * cp} equal chunks (a head and "
            f"a tail per rank); use a multiple of {2 * cp}"
        )
