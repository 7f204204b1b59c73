#!/usr/bin/env bash
# Train BabyGPT's mixture of experts with expert parallelism on NPROC processes (default 4): GPUs with NCCL when every
# process has one, otherwise CPU with gloo. Flags go to train_ep.py (python train_ep.py --help lists them).
#   bash run_ep.sh                        # 8 experts per block spread over 4 EP ranks, 2 on each
#   bash run_ep.sh --ep 2                 # 2 groups of 2 EP ranks (FSDP x EP), 4 experts on each rank
#   NPROC=2 bash run_ep.sh --experts 4 --top-k 1
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
if (( MIN_NODES != MAX_NODES )); then  # a restart would change the EP degree (experts per rank) under the run
  echo "error: NNODES=$NNODES: elastic training is supported by run_ddp.sh and run_fsdp.sh, not by EP; use a fixed NNODES" >&2
  exit 2
fi
preflight ep "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_ep.py "${RESUME_ARGS[@]}" "$@"
