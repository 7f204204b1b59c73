"""A language model's throughput (--model gpt): tokens per second and, on a GPU, its model FLOPs utilization (MFU),
in every train record of metrics.jsonl and in run.json's "final" and "throughput" (MFU_DEFINITION says how each is
computed). common/recorder.py loads it for BabyGPT only."""

from __future__ import annotations

import re
from typing import Any

import torch

from common.config import Config

# A GPU's dense peak (no sparsity) in TFLOP/s by its dtype, from NVIDIA's data sheets: bf16 and fp16 on the tensor
# cores, tf32 (fp32 matmuls with TF32 allowed), fp32 on the CUDA cores (torch's default for fp32 matmuls); None: the
# GPU has no such unit. The first key that is a word of torch.cuda.get_device_name() names the GPU: "H100 PCIe"
# before "H100" (the SXM), "A10" is not "A10G". Another GPU's run records its tokens/s and no MFU.
GPU_PEAK_TFLOPS = {  # name: (bf16, fp16, tf32, fp32)
    "GH200": (989.4, 989.4, 494.7, 66.9),
    "H200 NVL": (835.5, 835.5, 417.5, 60.0),
    "H200": (989.4, 989.4, 494.7, 66.9),
    "H100 NVL": (835.5, 835.5, 417.5, 60.0),
    "H100 PCIe": (756.5, 756.5, 378.0, 51.2),
    "H100": (989.4, 989.4, 494.7, 66.9),
    "A100": (312.0, 312.0, 156.0, 19.5),
    "L40S": (362.1, 362.1, 183.0, 91.6),
    "L4": (121.0, 121.0, 60.0, 30.3),
    "A10": (125.0, 125.0, 62.5, 31.2),
    "RTX 4090": (165.2, 165.2, 82.6, 82.6),
    "RTX 3090": (71.0, 71.0, 35.6, 35.6),
    "V100": (None, 125.0, None, 15.7),
    "T4": (None, 65.0, None, 8.1),
}
MFU_DEFINITION = (
    "tokens_per_s = sequences x --seq-len per second, over the global batch; mfu = flops_per_token x tokens_per_s / "
    "(peak_flops_per_device x world_size), on CUDA only. flops_per_token = 6 x N + 12 x depth x width x seq_len: N "
    "the parameters of the matrix multiplies (the blocks' q, k, v, o and SwiGLU, and the output layer; not the "
    "embedding's lookup nor the RMSNorms), 2 FLOPs each per token forward and 4 backward, and the attention's scores "
    "and weighted sum, a full seq_len x seq_len square as the kernel computes it (4 x width x seq_len a layer forward)"
)


def gpt_flops_per_token(
    size: str, *, vocab: int, seq_len: int, heads: int = 0, kv_heads: int = 0, experts: int = 0, top_k: int = 0,
    shared: bool = False,
) -> int:  # fmt: skip
    """Training FLOPs per token of BabyGPT (forward and backward): 6 x N + 12 x depth x width x seq_len, N the
    parameters of its matrix multiplies (MFU_DEFINITION) that a token runs through: with `experts`, the router's
    and its `top_k` experts' (and the shared one's), not the other experts'."""
    from common.gpt_sizes import GPT_SIZES, gpt_heads

    shape = GPT_SIZES[size]
    heads, kv_heads = gpt_heads(size, heads, kv_heads)
    kv_width = shape.width // heads * kv_heads
    mlp = 3 * shape.width * shape.mlp
    if experts:  # a mixture of experts: the router, then top_k experts' SwiGLUs (+ the shared expert's) per token
        mlp = shape.width * experts + 3 * shape.width * (shape.expert_mlp or shape.mlp) * (top_k + shared)
    per_block = 2 * shape.width * shape.width + 2 * shape.width * kv_width + mlp
    matmul_params = shape.depth * per_block + shape.width * vocab  # (a tied output layer multiplies too)
    return 6 * matmul_params + 12 * shape.depth * shape.width * seq_len


def peak_flops(device_name: str, precision: str, *, tf32: bool = False) -> float | None:
    """One GPU's dense peak FLOP/s in the run's dtype (fp32: TF32's where allowed), or None for a GPU not in
    GPU_PEAK_TFLOPS."""
    for name, peaks in GPU_PEAK_TFLOPS.items():
        if re.search(rf"(?<!\w){re.escape(name)}(?!\w)", device_name):
            column = {"bf16": 0, "fp16": 1}.get(precision, 2 if tf32 else 3)
            return None if peaks[column] is None else peaks[column] * 1e12
    return None


class Throughput:
    """One run's tokens per sequence, training FLOPs per token and, on CUDA, one GPU's peak in the run's dtype."""

    def __init__(self, cfg: Config, device: torch.device, *, world_size: int) -> None:
        from common.model_sizes import gpt_vocab

        self.seq_len, self.world_size = cfg.seq_len, world_size
        vocab = gpt_vocab(cfg.model_size, cfg.dataset)
        kw = {"vocab": vocab, "seq_len": cfg.seq_len, "heads": cfg.heads, "kv_heads": cfg.kv_heads}
        kw |= {"experts": cfg.experts, "top_k": cfg.top_k, "shared": cfg.shared_expert}  # (--experts: the active ones)
        self.flops_per_token = gpt_flops_per_token(cfg.model_size, **kw)
        self.device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else None
        tf32 = torch.backends.cuda.matmul.allow_tf32 or torch.get_float32_matmul_precision() != "highest"
        self.peak = peak_flops(self.device_name, cfg.precision, tf32=tf32) if self.device_name else None

    def rates(self, samples_per_s: float) -> dict[str, Any]:
        """tokens_per_s and mfu (None off CUDA, or on a GPU without a known peak) at `samples_per_s` sequences."""
        tokens_per_s = samples_per_s * self.seq_len
        mfu = self.flops_per_token * tokens_per_s / (self.peak * self.world_size) if self.peak else None
        return {"tokens_per_s": tokens_per_s, "mfu": mfu}

    def report(self, final: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
        """run.json's "final" with the launch's tokens_per_s and mfu (from its samples_per_s; None without one), and
        its "throughput" section put in `sections`: what they were computed from."""
        sections["throughput"] = self.section()
        samples_per_s = final["samples_per_s"]
        return final | (self.rates(samples_per_s) if samples_per_s else {"tokens_per_s": None, "mfu": None})

    def said(self, final: dict[str, Any]) -> str:
        """The final line's part: "12345 tokens/s | " and, on a GPU of known peak, "MFU 41.0% | "."""
        tokens = f"{final['tokens_per_s']:.0f} tokens/s | " if final["tokens_per_s"] else ""
        return tokens + (f"MFU {100 * final['mfu']:.1f}% | " if final["mfu"] else "")

    def section(self) -> dict[str, Any]:
        """run.json's "throughput": what tokens_per_s and mfu were computed from."""
        return {"seq_len": self.seq_len, "flops_per_token": self.flops_per_token, "device_name": self.device_name,
                "peak_flops_per_device": self.peak, "definition": MFU_DEFINITION}  # fmt: skip
