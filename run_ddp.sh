#!/usr/bin/env bash
# Train BabyCNN with DDP on NPROC processes (default 4): GPUs with NCCL when every process has one,
# otherwise CPU with gloo. Flags go to train_ddp.py (python train_ddp.py --help lists them).
#   bash run_ddp.sh --epochs 3 --lr 1e-3
#   NPROC=2 bash run_ddp.sh
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
preflight ddp "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_ddp.py "${RESUME_ARGS[@]}" "$@"
