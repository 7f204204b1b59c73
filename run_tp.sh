#!/usr/bin/env bash
# Train BabyCNN with tensor parallelism on NPROC processes (default 4): GPUs with NCCL when every process has
# one, otherwise CPU with gloo. Flags go to train_tp.py (python train_tp.py --help lists them).
#   bash run_tp.sh                    # 4-way TP: every layer pair split over the 4 processes
#   bash run_tp.sh --dp 2             # FSDP x TP: 2 replicas (FSDP between them) x 2-way TP
#   NPROC=2 bash run_tp.sh
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
if (( MIN_NODES != MAX_NODES )); then  # not tested: a restart would change the TP degree under the run
  echo "error: NNODES=$NNODES: elastic training is supported by run_ddp.sh and run_fsdp.sh, not by TP; use a fixed NNODES" >&2
  exit 2
fi
preflight tp "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_tp.py "${RESUME_ARGS[@]}" "$@"
