#!/usr/bin/env bash
# Train BabyCNN with FSDP on NPROC processes (default 4): GPUs with NCCL when every process has one,
# otherwise CPU with gloo. Flags go to train_fsdp.py (python train_fsdp.py --help lists them).
#   bash run_fsdp.sh --sharding grad-op --precision bf16
#   NPROC=2 bash run_fsdp.sh
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
preflight fsdp "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_fsdp.py "${RESUME_ARGS[@]}" "$@"
