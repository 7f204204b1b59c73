#!/usr/bin/env bash
# The suite on one CUDA GPU, in one pass: every script with one process (fp32, bf16, fp16, CPU offload,
# compile, checkpoint and resume, memory snapshot), the larger model sizes, a matmul's FLOP/s, and as much of
# pytest as the time allows (on the other half of the cores, so it does not slow the timed runs).
#   OUT=/tmp/gpu bash bench/gpu_proof.sh   # $OUT/gpu_proof.tgz: logs/ (summary.txt, pytest.log) and runs/*/*.json*
#   QUICK=1 skips the precisions, offload, pipeline and compile runs.
# docs/benchmarks/2026-11-27-h100-gpu-proof.md is what one pass measured.
set -uo pipefail
TGZ=${OUT:?set OUT to a folder for the results}/gpu_proof.tgz
OUT=$(mktemp -d)  # the runs (checkpoints, model.pt of GBs); what comes back is packed into $TGZ at the end
PY=${PYTHON:-python3}
mkdir -p "$OUT/runs" "$OUT/logs"
CORES=$(nproc); HALF=$((CORES / 2))
FG="taskset -c 0-$((HALF - 1))"   # the timed GPU runs
BG="taskset -c $HALF-$((CORES - 1))"   # pytest

{ nvidia-smi; $PY -c "import torch, torchvision; print(torch.__version__, torchvision.__version__, torch.version.cuda, torch.cuda.get_device_name())"; } \
  >"$OUT/logs/env.txt" 2>&1

# pytest in the background, on its own cores, for as long as the foreground runs last
( $BG timeout "${PYTEST_S:-400}" $PY -m pytest -q -rfE -p no:cacheprovider tests >"$OUT/logs/pytest.log" 2>&1;
  echo "pytest exit $?" >>"$OUT/logs/pytest.log" ) &

run() {  # run NAME TIMEOUT_S ARGS...: one process, its stdout and run.json under $OUT
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  $FG timeout "$limit" $PY "$@" --out "$OUT/runs/$name" >>"$OUT/logs/$name.log" 2>&1
  echo "$name rc=$? $((SECONDS - t0)) s: $*" | tee -a "$OUT/logs/summary.txt"
  tail -1 "$OUT/logs/$name.log" | tee -a "$OUT/logs/summary.txt"
}

$FG timeout 60 $PY - >"$OUT/logs/matmul.txt" 2>&1 <<'EOF'
import time, torch
for dtype, tf32 in ((torch.bfloat16, False), (torch.float16, False), (torch.float32, False), (torch.float32, True)):
    torch.backends.cuda.matmul.allow_tf32 = tf32
    a = torch.randn(8192, 8192, device="cuda", dtype=dtype); b = torch.randn_like(a)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter(); n = 20
    for _ in range(n): a @ b
    torch.cuda.synchronize(); s = (time.perf_counter() - t) / n
    print(f"matmul 8192 {dtype} tf32={tf32}: {2 * 8192**3 / s / 1e12:.1f} TFLOP/s")
EOF

# the default runs, one process each, on CUDA (--device auto picks it)
run ddp 90 train_ddp.py
run ddp-again 90 train_ddp.py
run fsdp 90 train_fsdp.py
[[ -n ${QUICK:-} ]] || {
run fsdp-bf16 90 train_fsdp.py --precision bf16
run ddp-bf16 90 train_ddp.py --precision bf16
run ddp-fp16 90 train_ddp.py --precision fp16
run fsdp-offload 120 train_fsdp.py --cpu-offload
run pippy 90 train_pippy.py
run pippy-interleaved 90 train_pippy.py --schedule interleaved-1f1b --stages-per-rank 2
run tp 90 train_tp.py
}
run vit 120 train_ddp.py --model vit --max-steps 200
[[ -n ${QUICK:-} ]] || run vit-bf16 120 train_fsdp.py --model vit --max-steps 200 --precision bf16
# checkpoint and resume: 30 steps, then on to 60, against 60 without a stop
run resume 90 train_fsdp.py --max-steps 30 --checkpoint-every 30
run resume 90 train_fsdp.py --max-steps 60 --checkpoint-every 30 --resume
run straight 90 train_fsdp.py --max-steps 60 --checkpoint-every 30
run snapshot 60 train_fsdp.py --max-steps 5 --profile-steps 3:5 --memory-snapshot
# the same seed gives the same run, and the resumed run the uninterrupted one: bit for bit, or the first step apart
$PY - "$OUT/runs" >>"$OUT/logs/summary.txt" 2>&1 <<'EOF'
import json, sys
def losses(run):
    rows = map(json.loads, open(f"{sys.argv[1]}/{run}/metrics.jsonl"))
    return [(r["step"], r["loss"]) for r in rows if r.get("kind") == "train"]
for a, b in (("ddp", "ddp-again"), ("resume", "straight")):
    x, y = losses(a), losses(b)
    apart = [s for (s, u), (_, v) in zip(x, y) if u != v] or [min(len(x), len(y))]
    print(f"{a} vs {b}: " + (f"bit for bit over {len(x)} steps" if x == y else f"apart from step {apart[0]}"))
EOF
# several ranks on the one GPU: the suite's answer
$FG timeout 60 env NPROC=2 bash run_ddp.sh --device cuda --max-steps 3 --out "$OUT/runs/two" >"$OUT/logs/two.log" 2>&1
echo "two ranks on one GPU rc=$?: $(tail -1 "$OUT/logs/two.log")" | tee -a "$OUT/logs/summary.txt"
# larger sizes: samples/s and CUDA peak against the planner's plan and time
for size in medium large; do
  run "cnn-$size-ddp" 90 train_ddp.py --model-size "$size" --max-steps 30 --batch-size 128
  run "cnn-$size-fsdp-bf16" 90 train_fsdp.py --model-size "$size" --max-steps 30 --batch-size 128 --precision bf16
  run "vit-$size-ddp-bf16" 120 train_ddp.py --model vit --model-size "$size" --max-steps 30 --batch-size 128 --precision bf16
done
[[ -n ${QUICK:-} ]] || {
run ddp-compile 150 train_ddp.py --compile
run fsdp-compile 150 train_fsdp.py --compile
run vit-compile 150 train_ddp.py --model vit --max-steps 200 --compile
}
wait
cd "$OUT" && tar czf "$TGZ" logs $(find runs -name '*.json' -o -name '*.jsonl' | grep -v checkpoints)
