#!/usr/bin/env bash
# Train BabyCNN with pipeline parallelism on NPROC processes (default 4): GPUs with NCCL when every
# process has one, otherwise CPU with gloo. Flags go to train_pippy.py (python train_pippy.py --help).
#   bash run_pippy.sh --schedule gpipe --n-microbatches 8
#   bash run_pippy.sh --schedule interleaved-1f1b --stages-per-rank 2
#   bash run_pippy.sh --dp 2          # 2 pipeline replicas x 2 stages
# Several machines: NNODES, NODE_RANK, MASTER_ADDR (see runner/launch.sh and the README).
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
if (( MIN_NODES != MAX_NODES )); then  # not tested: a restart with fewer ranks would have to re-cut the stages
  echo "error: NNODES=$NNODES: elastic training is supported by run_ddp.sh and run_fsdp.sh, not by the pipeline; use a fixed NNODES" >&2
  exit 2
fi
preflight pippy "${RESUME_ARGS[@]}" "$@"
# runner/supervise.py runs torchrun: signals (Ctrl-C, preemption) and how the run ended, each in one line
exec "$PYTHON" -m runner.supervise -- "$PYTHON" -m torch.distributed.run "${TORCHRUN_ARGS[@]}" train_pippy.py "${RESUME_ARGS[@]}" "$@"
