#!/usr/bin/env bash
# One device call: build megart for the GPU, run the GPU tests, then the named benchmark steps.
# Usage (on the lent GPU machine, repo root): bash bench/gpu_session.sh [step ...]
# Steps: selftest train-default tests ln-tests allreduce p2p nccl-overhead adam kernels kernels-ln
# profile-ln train-1.3b train-1.3b-fused train-1.3b-50k train-1.3b-50k-fused train-1.3b-recompute
# plan-1.3b plan-1.3b-recompute gemm-sweep layer-profile grad-accum-fusion residual-precision
# half-weights train-1.3b-half plan-1.3b-half cpu-tests cpu-tests-trainer ring-flash async-save
# core-so, or any shell command.
# The first session with a GPU (one H200, 2026-11-26; bench/RESULTS.md) ran
#   STEP_TIMEOUT=110 bash bench/gpu_session.sh selftest train-default tests train-1.3b kernels \
#     adam train-1.3b-fused nccl-overhead
# in 273 s, the build included (half of it cached from a failed first try). The second (same
# day) ran selftest ln-tests profile-ln train-1.3b plan-1.3b kernels-ln train-1.3b-recompute
# plan-1.3b-recompute train-1.3b-fused in 323 s, build included. The third (same day) ran
# selftest tests gemm-sweep, then layer-profile, then two profiled train runs and three more
# plan-vs-run sizes: 785 s over four calls. The fourth (same night) ran the fusion's tests and
# grad-accum-fusion, then train-1.3b plan-1.3b, selftest, and grad_accum_fusion.py --profile:
# 696 s over four calls. The fifth (one H100, 2026-11-27) ran selftest train-1.3b plan-1.3b
# cpu-tests and grad_accum_fusion.py, then cpu-tests tests: 702 s over two calls, starts
# included. Next, for the 16-bit residual stream (2026-11-27): `bash bench/gpu_session.sh
# selftest tests residual-precision train-1.3b plan-1.3b`, then in a second call cpu-tests
# cpu-tests-trainer; for --half-weights (same day) a third: half-weights train-1.3b-half
# plan-1.3b-half. The sixth (one H200, 2026-11-27) ran `STEP_TIMEOUT=125 bash bench/gpu_session.sh
# selftest tests residual-precision half-weights train-1.3b-half plan-1.3b-half` (the tests step
# ran out of time and was rerun alone, in 180 s): 673 s over two calls, start included. Next:
# train-1.3b plan-1.3b (the defaults since the 16-bit residual stream), cpu-tests
# cpu-tests-trainer, grad-accum-fusion. The seventh (one H200, 2026-11-28) ran
# `STEP_TIMEOUT=110 bash bench/gpu_session.sh core-so selftest ring-flash async-save tests
# train-1.3b plan-1.3b` in 399 s (467 s of device time with the start), then the flash ring's
# tests in a second call (core-so's extension lacks megart's CUDA module: build, do not carry).
# Next: `STEP_TIMEOUT=110 bash bench/gpu_session.sh selftest tests` (the selftest's ring-block,
# windowed-ring and sliding-window checks and the GPU tests of tests/test_context_parallel_ring.py
# and tests/test_ring_window_blocks.py are unrun on a GPU), then ring-flash (its windowed run
# too). On a node of several GPUs:
# `torchrun --nproc-per-node N -m megart selftest`, NPROC=N allreduce p2p, and tests (whose
# test_trainer_nccl runs every parallel layout, its ranks sharing GPU 0).
# (-fused adds --bias-gelu-fusion --fused-layer-norm --cross-entropy-loss-fusion; -50k trains
# on GPT-2's vocabulary size, where the cross-entropy weighs; -recompute recomputes every layer.
# plan-1.3b[-recompute] sets `megart plan`'s prediction beside that run's log, memory included.)
# Each step has its own time limit (STEP_TIMEOUT, seconds) so that one hang costs one step, not
# the call. Logs go to $OUT (or ./gpu_out); each step's output also prints, last lines last.
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
STEP_TIMEOUT=${STEP_TIMEOUT:-150}
log() { echo "=== $* ($(date +%T))"; }
limit() { timeout -k 5 "$STEP_TIMEOUT" "$@"; }
# Every step's whole output goes to $OUT/steps.log, its last lines to the terminal: the device
# tool returns at most 8 files, so the steps share one log.
show() { tee -a "$OUT/steps.log" | tail -n "$1"; }

log "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
# megart plan's profile for this GPU (plan-* steps); GPU_PROFILE=FILE or a name overrides it.
case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
  *H200*) detected=h200 ;; *H100*) detected=h100-80gb ;; *A100*) detected=a100-80gb ;; *) detected=h200 ;;
esac
GPU_PROFILE=${GPU_PROFILE:-$detected}
echo "plan profile: $GPU_PROFILE"

log "build"
# Hopper only on this machine: one architecture halves the build time.
# --no-build-isolation: nothing can be fetched there, so the image's scikit-build-core, pybind11,
# cmake and ninja build it; a read-only site-packages falls back to a --target folder.
export CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90"
python3 -m pip install --no-build-isolation --no-deps -q . >"$OUT/build.log" 2>&1 ||
  { python3 -m pip install --no-build-isolation --no-deps -q --target /tmp/site . \
      >>"$OUT/build.log" 2>&1 && export PYTHONPATH=/tmp/site; } ||
  { tail -60 "$OUT/build.log"; exit 1; }
python3 -c "import megart, json; print(json.dumps(megart.build_info()))"
log "built"

for step in "$@"; do
  log "$step" | tee -a "$OUT/steps.log"
  case "$step" in
    selftest) limit python3 -m megart selftest --json "$OUT/selftest.json" 2>&1 | show 50 ;;
    train-default) limit python3 -m megart train 2>&1 | show 8 ;;
    ln-tests) limit python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels_cuda.py \
             tests/test_build_info.py 2>&1 | show 20 ;;
    gemm-sweep) limit python3 bench/gemm_sweep.py --json "$OUT/gemm_sweep.json" 2>&1 | show 60 ;;
    layer-profile) for a in "" "--hidden 4096 --heads 32 --micro-batch 2"; do
             limit python3 bench/layer_profile.py $a; done 2>&1 | show 80 ;;
    kernels-ln) limit python3 bench/kernels.py --ops add_layer_norm --json "$OUT/kernels_ln.json" \
             2>&1 | show 20 ;;
    plan-1.3b*) # the model and layout of train-1.3b (byte vocabulary), on this one GPU
      extra=()
      case "$step" in *-recompute) extra+=(--recompute-granularity full) ;; esac
      case "$step" in *-half) extra+=(--half-weights) ;; esac
      limit python3 bench/plan_vs_run.py --log-jsonl "$OUT/train${step#plan}.jsonl" --gpu "$GPU_PROFILE" \
        --num-gpus 1 --num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 \
        --vocab-size 256 --global-batch-size 32 --micro-batch-size 4 --bf16 --hidden-dropout 0 \
        --tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 "${extra[@]}" 2>&1 | show 12 ;;
    cpu-tests) # the multi-rank CPU tests on a GPU machine (their ranks must not take the GPU);
      # on an H100's 16 cores the three files took over 170 s, so they come in two steps
      limit python3 -m pytest -q -p no:cacheprovider tests/test_grad_accumulation_fusion.py \
        tests/test_distributed.py 2>&1 | show 20 ;;
    cpu-tests-trainer) limit python3 -m pytest -q -p no:cacheprovider tests/test_trainer.py \
        tests/test_residual_precision.py 2>&1 | show 20 ;;
    tests) # 203 tests took 171 s on an H200 (2026-11-27): at least 240 s whatever STEP_TIMEOUT
      timeout -k 5 "$((STEP_TIMEOUT > 240 ? STEP_TIMEOUT : 240))" python3 -m pytest -q -p no:cacheprovider tests/test_nccl.py tests/test_trainer_nccl.py \
             tests/test_optim_cuda.py "tests/test_grad_accumulation_fusion.py::test_cuda_fused_product_accumulates_in_fp32" \
             tests/test_kernels.py tests/test_fused_kernels_cuda.py tests/test_build_info.py \
             "tests/test_context_parallel.py::test_the_blockwise_attention_on_a_gpu_is_the_masked_one_in_float64" \
             tests/test_flash_blocks.py "tests/test_context_parallel_ring.py::test_on_a_gpu_the_flash_ring_in_bf16_is_one_process_attention_in_float64" \
             tests/test_selftest_windows.py \
             "tests/test_ring_window_blocks.py::test_on_a_gpu_the_windowed_ring_is_one_process_attention_in_float64" \
             2>&1 | show 40 ;;
    grad-accum-fusion) # fused against unfused, alternating: train-1.3b's GPT, then a 2.5B one
      for a in "" "--layers 32 --hidden 2560 --heads 32"; do
        limit python3 bench/grad_accum_fusion.py $a; done 2>&1 | show 12 ;;
    residual-precision) # the bf16 residual stream against --fp32-residual-connection, the same way
      limit python3 bench/grad_accum_fusion.py --compare residual --profile 2>&1 | show 40 ;;
    half-weights) # --half-weights against fp32 weights under autocast, the same way
      limit python3 bench/grad_accum_fusion.py --compare weights --profile 2>&1 | show 40 ;;
    ring-flash) # the ring's blocks by torch's flash kernels against its explicit products, then
      # a windowed ring's pieces by the memory-efficient kernel against its explicit products
      for a in "" "--window 4096"; do limit python3 bench/ring_flash.py $a; done 2>&1 | show 40 ;;
    async-save) limit bash bench/async_save_check.sh 2>&1 | show 10 ;;
    core-so) # the built extension, for a later call on a fresh machine to use without a build
      cp "$(python3 -c 'import megart._core as c; print(c.__file__)')" "$OUT/" && ls -la "$OUT" ;;
    kernels) limit python3 bench/kernels.py --json "$OUT/fused_kernels.json" 2>&1 | show 60 ;;
    allreduce|p2p) # NPROC=N: N ranks, one per GPU
      limit python3 -m megart.cli.bench "$step" --backend nccl ${NPROC:+--nproc "$NPROC"} -b 8 \
        -e 256M -f 8 -n 50 -w 10 --json "$OUT/nccl_$step.json" 2>&1 | show 20 ;;
    nccl-overhead) limit python3 bench/nccl_overhead.py --json "$OUT/nccl_overhead.json" 2>&1 | show 12 ;;
    profile-ln) for a in "--dtype bfloat16" "--dtype float32" "--dtype bfloat16 --tokens 16384 \
             --hidden 4096"; do limit python3 bench/kernel_profile.py $a; done 2>&1 | show 60 ;;
    adam) limit python3 bench/adam_gpu.py --json "$OUT/adam_gpu.json" 2>&1 | show 12 ;;
    train-1.3b*) # GPT-3 XL shape (24 x 2048, 16 heads, seq 2048): 1.21B with the byte vocab;
      # -50k: GPT-2's vocabulary size on random tokens (1.31B), where the cross-entropy weighs
      extra=()
      case "$step" in *-50k*) extra+=(--mock-data --tokenizer-type NullTokenizer \
        --vocab-size 50256 --eval-iters 0) ;; esac
      case "$step" in *-recompute) extra+=(--recompute-granularity full --recompute-method uniform \
        --recompute-num-layers 1) ;; esac
      case "$step" in *-half) extra+=(--half-weights) ;; esac
      case "$step" in *-fused) extra+=(--bias-gelu-fusion --fused-layer-norm \
        --cross-entropy-loss-fusion) ;; esac
      # The settings of the recorded runs (megart's defaults until 2026-11-27, Megatron's since).
      extra+=(--hidden-dropout 0 --attention-dropout 0 --adam-beta2 0.95 --lr-decay-style cosine)
      limit python3 -m megart train --bf16 "${extra[@]}" --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
        --seq-length 2048 --micro-batch-size 4 --global-batch-size 32 --train-iters 30 \
        --lr 2e-4 --min-lr 2e-5 --lr-warmup-iters 5 --log-interval 5 \
        --log-jsonl "$OUT/$step.jsonl" 2>&1 | show 12 ;;
    *) limit bash -c "$step" 2>&1 | show 40 ;;
  esac
done
