"""BabyViT's sizes, loaded only with --model vit: --model-size -> (patch, width, depth, heads, MLP width). The first
four train on the 28 x 28 images here (16 tokens); the published shapes (ViT-Ti/16 ... ViT-22B) are planned at
224 x 224 with 1,000 classes. No torch here: the runners check a size before torchrun starts."""

VIT_SIZES = {
    "baby": (7, 64, 6, 4, 256),  # 0.3 M parameters, the default
    "small": (7, 256, 8, 8, 1024),  # 6.3 M
    "medium": (7, 1024, 16, 16, 4096),  # 202 M: DDP's training state, 3.2 GB per rank, fits 4 CPU processes
    "large": (7, 1536, 24, 16, 6144),  # 680 M: DDP's 10.9 GB per rank does not fit 4 processes; FSDP's 2.7 GB does
    "ti16": (16, 192, 12, 3, 768),
    "s16": (16, 384, 12, 6, 1536),
    "b16": (16, 768, 12, 12, 3072),
    "l16": (16, 1024, 24, 16, 4096),
    "h14": (14, 1280, 32, 16, 5120),
    "g14": (14, 1408, 40, 16, 6144),
    "22b": (14, 6144, 48, 48, 24576),
}
