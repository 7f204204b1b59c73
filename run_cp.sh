#!/usr/bin/env bash
# Train BabyGPT with context parallelism on NPROC processes (default 4): GPUs with NCCL when every process has
# one, otherwise CPU with gloo. Flags go to train_cp.py (python train_cp.py --help lists them).
#   bash run_cp.sh                        # 4-way CP: every sequence's tokens split over the 4 processes
#   bash run_cp.sh --seq-len 1024 --dp 2  # 2 replicas x 2-way CP, sequences of 1,024 tokens
#   NPROC=2 bash run_cp.sh
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
if (( MIN_NODES != MAX_NODES )); then  # not tested: a restart would change the CP degree under the run
  echo "error: NNODES=$NNODES: elastic training is supported by run_ddp.sh and run_fsdp.sh, not by CP; use a fixed NNODES" >&2
  exit 2
fi
preflight cp "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_cp.py "${RESUME_ARGS[@]}" "$@"
