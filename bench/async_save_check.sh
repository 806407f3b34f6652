#!/usr/bin/env bash
# --async-save on this machine's device (a GPU where there is one): a run that saves
# asynchronously at iteration 4 and one that resumes from it to 8 against one run of 8 without
# a save; the resumed iterations' losses must be the uninterrupted run's.
# Usage: bash bench/async_save_check.sh [extra megart train flags]
set -euo pipefail
dir=$(mktemp -d)
run() {
  python3 -m megart train --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
    --micro-batch-size 4 --global-batch-size 8 --lr 1e-3 --hidden-dropout 0 --attention-dropout 0 \
    --log-interval 1 --eval-iters 0 "$@"
}
run --train-iters 8 --log-jsonl "$dir/whole.jsonl" > "$dir/whole.log"
run --train-iters 8 --exit-interval 4 --save "$dir/ckpt" --save-interval 4 --ckpt-format torch_dist \
  --async-save --log-jsonl "$dir/first.jsonl" > "$dir/first.log"
run --train-iters 8 --load "$dir/ckpt" --save "$dir/ckpt" --save-interval 4 --ckpt-format torch_dist \
  --async-save --log-jsonl "$dir/resumed.jsonl" > "$dir/resumed.log"
python3 - "$dir" <<'PY'
import json, sys
d = sys.argv[1]
def losses(name):
    rows = [json.loads(line) for line in open(f"{d}/{name}.jsonl")]
    return {r["iteration"]: r["loss"] for r in rows if "loss" in r and "iteration" in r}
whole, first, resumed = losses("whole"), losses("first"), losses("resumed")
print("iterations: whole", sorted(whole), "first", sorted(first), "resumed", sorted(resumed))
worst = max(abs(resumed[i] - whole[i]) / abs(whole[i]) for i in resumed)
print("resumed losses", [round(resumed[i], 6) for i in sorted(resumed)])
print("whole losses  ", [round(whole[i], 6) for i in sorted(resumed)])
print(f"async save + resume vs uninterrupted: largest relative loss difference {worst:.2e}")
sys.exit(0 if resumed and min(resumed) == 5 and worst < 1e-3 else 1)
PY
ls "$dir/ckpt"
