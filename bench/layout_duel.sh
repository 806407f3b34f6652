#!/usr/bin/env bash
# Two layouts of one model on one node, each run with megart train and set beside megart plan's
# prediction (bench/plan_vs_run.py): the measurement that would settle issue 14's 18.4B row,
# where the planner predicts SC21 Table 1's layout (t 8, p 1) slower than t 2, p 4 interleaved.
# The default is one data-parallel replica of Table 1's 18.4B run (40 layers, hidden 6144, 48
# heads, sequence 2048, 32 sequences per iteration, full recomputation, bf16) on 8 GPUs: plan
# predicts (megart's runtime, a100-80gb) 7.58 s for t8 p1 b16 and 6.99 s for t2 p4 b2 v5, both
# within 44 GiB per GPU (46 with --fp32-residual-connection). Nothing here has run on GPUs yet;
# a run's figures belong in bench/RESULTS.md with the date, the GPUs and this command.
#
#   bash bench/layout_duel.sh                       # on an 8 x A100-80GB node
#   GPU=h100-80gb bash bench/layout_duel.sh         # another node: name its plan profile
#
# MODEL, TRAIN_ONLY, LAYOUT_A, LAYOUT_B, NPROC, ITERS and OUT override the defaults. Checked on
# a 2-core CPU (2026-11-26, both layouts, 8 ranks): MODEL="--num-layers 8 --hidden-size 64
# --num-attention-heads 8 --seq-length 32 --global-batch-size 32 --recompute-granularity full
# --sequence-parallel" bash bench/layout_duel.sh (its predictions are for GPUs: time only).
set -euo pipefail
GPU=${GPU:-a100-80gb}
NPROC=${NPROC:-8}
ITERS=${ITERS:-8}
OUT=${OUT:-layout_duel}
# MODEL goes to megart train and megart plan; TRAIN_ONLY to megart train alone.
MODEL=${MODEL:-"--num-layers 40 --hidden-size 6144 --num-attention-heads 48 --seq-length 2048
  --vocab-size 51200 --global-batch-size 32 --recompute-granularity full --sequence-parallel
  --bf16"}
TRAIN_ONLY=${TRAIN_ONLY:-"--recompute-method uniform --eval-iters 0"}
LAYOUT_A=${LAYOUT_A:-"--tensor-model-parallel-size 8 --pipeline-model-parallel-size 1
  --micro-batch-size 16"}
LAYOUT_B=${LAYOUT_B:-"--tensor-model-parallel-size 2 --pipeline-model-parallel-size 4
  --micro-batch-size 2 --num-layers-per-virtual-pipeline-stage 2"}
mkdir -p "$OUT"
for name in A B; do
  layout_var="LAYOUT_$name"
  layout=${!layout_var}
  echo "=== layout $name: $layout ($(date +%T))"
  # shellcheck disable=SC2086 # the flag lists split into words on purpose
  torchrun --nproc-per-node "$NPROC" -m megart train $MODEL $TRAIN_ONLY $layout \
    --train-iters "$ITERS" --log-jsonl "$OUT/$name.jsonl" 2>&1 | tail -n 3
  # shellcheck disable=SC2086
  python3 bench/plan_vs_run.py --log-jsonl "$OUT/$name.jsonl" --gpu "$GPU" \
    --num-gpus "$NPROC" $MODEL $layout
done
