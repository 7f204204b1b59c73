# Shared by run_ddp.sh, run_fsdp.sh, run_pippy.sh, run_tp.sh and run_all.sh (sourced, not run). It picks the Python,
# validates the flags before any worker starts, and builds the torchrun arguments for one or several machines.
#
#   NPROC        processes per machine (default 4)
#   NNODES       machines (default 1); N: exactly N machines, with NODE_RANK and MASTER_ADDR set on each;
#                MIN:MAX: elastic, between MIN and MAX machines, with MASTER_ADDR set on each (NODE_RANK optional)
#   NODE_RANK    0 on the machine at MASTER_ADDR: its runner hosts the rendezvous store at MASTER_ADDR:MASTER_PORT
#                (default 29500), every other one connects to it; elastic without NODE_RANK: torch decides by address
#   MAX_RESTARTS times torchrun restarts the group after a worker fails or a machine joins or leaves
#                (default 0; 3 with NNODES=MIN:MAX)
#   RDZV_LAST_CALL_S, RDZV_KEEP_ALIVE_S  elastic only: how long a started group waits for more machines
#                (default 10 s), and the heartbeat interval (default 5 s; a machine is dead after 3 missed)
#   RDZV_JOIN_TIMEOUT_S  elastic only: how long an agent waits for MIN machines before it gives up (default 600 s)
#   PYTHON       the Python that has torch (default: .venv/bin/python if present, else python3)

cd "$(dirname "${BASH_SOURCE[0]}")/.."
NPROC=${NPROC:-4}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # the scripts set their own thread count on CPU; this only silences torchrun's notice
NNODES=${NNODES:-1}
if [[ -z "${PYTHON:-}" ]]; then
  if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ! command -v "$PYTHON" >/dev/null; then  # (bad input: one line and exit 2, not bash's 127)
  echo "error: PYTHON=$PYTHON: no such program; set PYTHON to the Python that has torch (pip install -r requirements.txt)" >&2
  exit 2
fi

if [[ $NNODES =~ ^([0-9]+):([0-9]+)$ ]]; then
  MIN_NODES=${BASH_REMATCH[1]} MAX_NODES=${BASH_REMATCH[2]}
  if (( MIN_NODES < 1 || MIN_NODES > MAX_NODES )); then
    echo "error: NNODES=$NNODES: MIN:MAX needs 1 <= MIN <= MAX, e.g. NNODES=1:2" >&2
    exit 2
  fi
  MAX_RESTARTS=${MAX_RESTARTS:-3}
elif [[ $NNODES =~ ^[0-9]+$ ]] && (( NNODES >= 1 )); then
  MIN_NODES=$NNODES MAX_NODES=$NNODES
  MAX_RESTARTS=${MAX_RESTARTS:-0}
else
  echo "error: NNODES=$NNODES must be a number of machines (NNODES=2) or a range for elastic training (NNODES=1:2)" >&2
  exit 2
fi
RDZV_LAST_CALL_S=${RDZV_LAST_CALL_S:-10} RDZV_KEEP_ALIVE_S=${RDZV_KEEP_ALIVE_S:-5} RDZV_JOIN_TIMEOUT_S=${RDZV_JOIN_TIMEOUT_S:-600}
for var in NPROC MAX_RESTARTS RDZV_LAST_CALL_S RDZV_KEEP_ALIVE_S RDZV_JOIN_TIMEOUT_S; do
  least=1; [[ $var == MAX_RESTARTS ]] && least=0
  if ! [[ "${!var}" =~ ^[0-9]+$ ]] || (( ${!var} < least )); then
    echo "error: $var=${!var} must be a whole number of at least $least" >&2
    exit 2
  fi
done

# preflight [--flags-only] STRATEGY [flags]: validate every flag for every world size the run may have, check
# that NPROC CPU processes fit in memory, fetch a missing torchvision data set once, and settle --out (refuse a
# resume that changes the run, stop at once if it is finished; on one machine, move a previous run aside),
# so bad input costs one line here instead of a traceback from each worker.
preflight() {
  local prepare=(--prepare-out)
  if [[ $1 == --flags-only ]]; then prepare=(); shift; fi
  (( MAX_NODES > 1 )) && prepare=()  # with several machines, rank 0 of the workers moves it (train_*.py)
  local strategy=$1; shift
  local sizes n
  sizes=$(for ((n = MIN_NODES; n <= MAX_NODES; n++)); do echo $((n * NPROC)); done | paste -sd,)
  local status=0
  "$PYTHON" -m runner.preflight "$strategy" --world-size "$sizes" --nproc "$NPROC" "${prepare[@]}" "$@" || status=$?
  (( status == 3 )) && exit 0  # the run is already finished: nothing to do (runner/preflight.py NOTHING_TO_DO)
  (( status == 0 )) || exit "$status"
}

# torchrun rendezvous: one machine uses --standalone (a free port, so two runs at once don't clash);
# several machines meet at MASTER_ADDR:MASTER_PORT through the c10d rendezvous backend.
TORCHRUN_ARGS=(--nproc-per-node "$NPROC" --max-restarts "$MAX_RESTARTS")
RESUME_ARGS=()  # flags the runner puts before the user's: (--resume) for an elastic job, below
if (( MAX_NODES == 1 )); then
  TORCHRUN_ARGS+=(--standalone)
else
  if (( MIN_NODES == MAX_NODES )) && { ! [[ "${NODE_RANK:-}" =~ ^[0-9]+$ ]] || (( 10#$NODE_RANK >= NNODES )); }; then
    echo "error: NODE_RANK='${NODE_RANK:-}': with NNODES=$NNODES set NODE_RANK to 0..$((NNODES - 1)), a different one on each machine" >&2
    exit 2
  fi
  if (( MIN_NODES < MAX_NODES )) && [[ -n "${NODE_RANK:-}" ]] && ! [[ $NODE_RANK =~ ^[0-9]+$ ]]; then
    echo "error: NODE_RANK='$NODE_RANK': with NNODES=$NNODES NODE_RANK is optional; set it to 0 on the machine at MASTER_ADDR, which hosts the rendezvous, and to 1, 2, ... on the others" >&2
    exit 2
  fi
  if [[ -z "${MASTER_ADDR:-}" ]]; then
    echo "error: MASTER_ADDR is not set: with NNODES=$NNODES set it to the address of machine 0 on every machine" >&2
    exit 2
  fi
  master_port=${MASTER_PORT:-29500}
  if ! [[ $master_port =~ ^[0-9]{1,5}$ ]] || (( 10#$master_port < 1 || 10#$master_port > 65535 )); then
    echo "error: MASTER_PORT=$master_port must be a TCP port, 1..65535, the same on every machine" >&2
    exit 2
  fi
  TORCHRUN_ARGS+=(--nnodes "$NNODES" --rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$((10#$master_port))"
                  --rdzv-id "${RDZV_ID:-babycnn}")
  # (no --node-rank: the c10d rendezvous numbers the machines itself, sorted by hostname and process id, and
  # ignores it with a warning; torch 2.14.1: torch/distributed/run.py, "node_rank is only used for static")
  RDZV_CONF=()
  # Who hosts the rendezvous store is told, not guessed: left to torch, every agent whose own address is
  # MASTER_ADDR tries to host it and the others connect, so of several agents on one machine the first to
  # bind MASTER_PORT hosts, and the store then dies with whichever machine that was. is_host=1 makes an agent
  # host the store or fail in one line; is_host=0 makes it wait for the host: torch's read_timeout of 60 s, then
  # once more after a random delay (~100 s measured) (torch 2.14.1: torch/distributed/elastic/rendezvous/
  # c10d_rendezvous_backend.py, _create_tcp_store; runner/supervise.py turns either failure into one line).
  if [[ -n "${NODE_RANK:-}" ]]; then
    RDZV_CONF+=("is_host=$(( 10#$NODE_RANK == 0 ))")  # (10#: "08" is 8, not a bad octal number)
  fi
  if (( MIN_NODES < MAX_NODES )); then
    # Elastic: once MIN machines are in, wait RDZV_LAST_CALL_S for more, then start. When a machine dies, the
    # others' workers fail at their next collective and their agents restart without it once its heartbeats
    # (every RDZV_KEEP_ALIVE_S) have stopped for 3 intervals: until then it still counts as a member. The
    # machine that hosts the store is the exception: without it the others stop (runner/supervise.py says so).
    RDZV_CONF+=("join_timeout=$RDZV_JOIN_TIMEOUT_S" "last_call_timeout=$RDZV_LAST_CALL_S" "close_timeout=10"
                "keep_alive_interval=$RDZV_KEEP_ALIVE_S")
    # A machine that joins a running group would wait for ever for the rendezvous' MASTER_ADDR: an agent
    # that already ran a round keeps its first round's store address and does not publish it again (torch
    # 2.14.1: torch/distributed/elastic/rendezvous/dynamic_rendezvous.py, next_rendezvous). Without the
    # shared store every round publishes its own, and the newcomer is taken in.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # Every start of an elastic job continues the run in --out: torchrun restarts the workers when a machine
    # joins without counting a restart (TORCHELASTIC_RESTART_COUNT stays 0), so only --resume tells them to
    # go on from the latest checkpoint instead of starting a new run. --no-resume after it opts out.
    RESUME_ARGS=(--resume)
  fi
  if (( ${#RDZV_CONF[@]} > 0 )); then
    TORCHRUN_ARGS+=(--rdzv-conf "$(IFS=,; echo "${RDZV_CONF[*]}")")
  fi
fi
