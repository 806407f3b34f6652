#!/usr/bin/env bash
# One device call: build megart for the GPU, run the GPU tests, then the named benchmark steps.
# Usage (on the lent GPU machine, repo root): bash bench/gpu_session.sh [step ...]
# Steps: tests allreduce p2p nccl-overhead adam kernels train-1.3b, or any shell command.
# Written without a GPU: the first session that has one runs
#   bash bench/gpu_session.sh tests nccl-overhead adam kernels train-1.3b allreduce
# and a second call with --bias-gelu-fusion --fused-layer-norm --cross-entropy-loss-fusion
# added to train-1.3b for the end-to-end effect of the kernels that beat torch.
# Logs go to $OUT (or ./gpu_out); each step's output also prints, last lines last.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
log() { echo "=== $* ($(date +%T))"; }

log "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

log "build"
# Hopper only on this machine: one architecture halves the build time.
CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90" pip install --no-build-isolation --no-deps -q . \
  >"$OUT/build.log" 2>&1 || { tail -60 "$OUT/build.log"; exit 1; }
python3 -c "import megart, json; print(json.dumps(megart.build_info()))"

for step in "$@"; do
  log "$step"
  case "$step" in
    tests) python3 -m pytest -q -p no:cacheprovider tests/test_nccl.py tests/test_optim_cuda.py \
             tests/test_kernels.py tests/test_fused_kernels_cuda.py tests/test_build_info.py 2>&1 \
             | tee "$OUT/gpu_tests.log" | tail -40 ;;
    kernels) python3 bench/kernels.py --json "$OUT/fused_kernels.json" 2>&1 | tail -60 ;;
    allreduce|p2p) megart-bench "$step" --backend nccl -b 8 -e 256M -f 8 -n 50 -w 10 \
             --json "$OUT/nccl_$step.json" 2>&1 | tail -20 ;;
    nccl-overhead) python3 bench/nccl_overhead.py --json "$OUT/nccl_overhead.json" 2>&1 | tail -12 ;;
    adam) python3 bench/adam_gpu.py --json "$OUT/adam_gpu.json" 2>&1 | tail -12 ;;
    train-1.3b) # GPT-3 XL shape (24 x 2048, 16 heads, seq 2048): 1.21B with the byte vocab
      megart train --bf16 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 2048 --micro-batch-size 4 --global-batch-size 32 --train-iters 30 \
        --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 5 --log-interval 5 \
        --log-jsonl "$OUT/train_1.3b.jsonl" 2>&1 | tail -15 ;;
    *) eval "$step" 2>&1 | tail -40 ;;
  esac
done
