# Shared by run_ddp.sh, run_fsdp.sh and run_pippy.sh (sourced, not run). It picks the Python, validates
# the flags before any worker starts, and builds the torchrun arguments for one or several machines.
#
#   NPROC        processes per machine (default 4)
#   NNODES       machines (default 1); with NNODES > 1 also set NODE_RANK and MASTER_ADDR (MASTER_PORT: 29500)
#   MAX_RESTARTS times torchrun restarts the whole group after a worker fails (default 0)
#   PYTHON       the Python that has torch (default: .venv/bin/python if present, else python3)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
NPROC=${NPROC:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the scripts set their own thread count on CPU; this only silences torchrun's notice
NNODES=${NNODES:-1}
MAX_RESTARTS=${MAX_RESTARTS:-0}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

for var in NPROC NNODES MAX_RESTARTS; do
  least=1; [[ $var == MAX_RESTARTS ]] && least=0
  if ! [[ "${!var}" =~ ^[0-9]+$ ]] || (( ${!var} < least )); then
    echo "error: $var=${!var} must be a whole number of at least $least" >&2
    exit 2
  fi
done

# preflight STRATEGY [flags]: validate every flag for NNODES x NPROC processes (and fetch a missing
# torchvision data set once), so bad input costs one line here instead of a traceback from each worker.
preflight() {
  local strategy=$1; shift
  "$PYTHON" -m common.preflight "$strategy" --world-size $((NNODES * NPROC)) "$@"
}

# torchrun rendezvous: one machine uses --standalone (a free port, so two runs at once don't clash);
# several machines meet at MASTER_ADDR:MASTER_PORT through the c10d rendezvous backend.
TORCHRUN_ARGS=(--nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS")
if (( NNODES > 1 )); then
  if ! [[ "${NODE_RANK:-}" =~ ^[0-9]+$ ]] || (( NODE_RANK >= NNODES )); then
    echo "error: NODE_RANK='${NODE_RANK:-}': with NNODES=$NNODES set NODE_RANK to 0..$((NNODES - 1)), a different one on each machine" >&2
    exit 2
  fi
  if [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "error: MASTER_ADDR is not set: with NNODES=$NNODES set it to the address of machine 0 on every machine" >&2
    exit 2
  fi
  TORCHRUN_ARGS+=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --rdzv-backend c10d
                  --rdzv-endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}" --rdzv-id "${RDZV_ID:-babycnn}")
else
  TORCHRUN_ARGS+=(--standalone)
fi
