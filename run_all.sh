#!/usr/bin/env bash
# Run a 1-process reference and the four strategies (BabyGPT: five, with CP) with the same flags, then compare them:
#   bash run_all.sh                          # defaults: runs/compare/{ref,ddp,fsdp,pippy,tp} + compare.png
#   bash run_all.sh --dropout 0 --max-steps 100
#   OUT=runs/bf16 bash run_all.sh --precision bf16
#   bash run_all.sh --model gpt              # BabyGPT through every strategy (--model vit: BabyViT)
# NPROC (default 4) processes for each strategy; the reference is `python train_ddp.py` on one process.
# Every run evaluates every 20 steps (for the accuracy panel) unless you pass --eval-every yourself.
set -euo pipefail
source "$(dirname "$0")/runner/launch.sh"
OUT=${OUT:-runs/compare}
for arg in "$@"; do
  if [[ $arg == --out || $arg == --out=* ]]; then
    echo "error: --out: run_all.sh chooses the run folders itself; set OUT=folder instead" >&2
    exit 2
  fi
done
set -- --eval-every 20 "$@"  # first, so that a --eval-every of yours comes later and wins
preflight --flags-only ddp "$@"  # the shared flags, checked once before anything runs

strategies=(ddp fsdp pippy tp)
# The reference runs where the strategies will (--device auto gives them CUDA only with a GPU per process: on a
# 1-GPU machine they run on the CPU, and a CUDA reference would differ by CUDA's arithmetic, not the strategy's).
# A torch older than tensor parallelism needs (docs/versions.md) still runs and compares the other three.
# A pipeline has at most as many stages as the model has blocks to cut (BabyGPT baby: 2): where NPROC ranks would
# be more stages, the pipeline runs as replicas of a shorter one (--dp, the fewest that fit), unless you pass --dp.
read -r ref_device has_tp < <("$PYTHON" -c 'import sys, torch; from common.versions import NEEDS_TP, older_than
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
print("auto" if gpus >= int(sys.argv[1]) else "cpu", int(not older_than(NEEDS_TP)))' "$NPROC")
read -r pipeline_dp model < <("$PYTHON" -m runner.layout "$NPROC" "$@")  # (no torch: the flags alone)
if (( ! has_tp )); then
  strategies=(ddp fsdp pippy)
  echo "== tp left out: this torch is older than tensor parallelism needs (docs/versions.md)"
fi
if [[ $model == gpt ]]; then
  strategies+=(cp)  # a language model: its sequences split over the ranks too (context parallelism)
fi

echo "== 1-process reference -> $OUT/ref"
"$PYTHON" train_ddp.py --device "$ref_device" "$@" --out "$OUT/ref"  # a --device of yours comes later and wins
for strategy in "${strategies[@]}"; do
  own=()
  if [[ $strategy == pippy ]] && (( pipeline_dp > 1 )); then
    own=(--dp "$pipeline_dp")
    echo "== pippy on $NPROC processes: $pipeline_dp replicas of a $((NPROC / pipeline_dp))-stage pipeline (the model has no more blocks to cut)"
  fi
  echo "== $strategy on $NPROC processes -> $OUT/$strategy"
  bash "run_$strategy.sh" "${own[@]}" "$@" --out "$OUT/$strategy"
done
echo "== comparison"
"$PYTHON" -m tools.compare "$OUT/ref" "${strategies[@]/#/$OUT/}" --out "$OUT/compare.png" --markdown
