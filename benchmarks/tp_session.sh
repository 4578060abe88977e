#!/bin/bash
# One device call on nvidia-h200-x2 (x4: TP=4) for tensor parallelism (issue 7), logs under $OUT. Stages
# (STAGES="symm comm check profile tests" by default; each has its own time limit T_*, so one
# that hangs leaves the others their time):
#   symm:    the TP kernels compiled for 2, 4 and 8 ranks with this image's Triton
#            (tests/hopper_compile.py), then the fused all-reduce + RMSNorm over symmetric memory
#            against NCCL's all-reduce + rms_norm on both GPUs (GPU test, about a minute);
#   comm:    the communication costs alone (benchmarks/probes/tp_comm.py);
#   check:   TP=$TP (default 2) vs TP=1: greedy agreement in bf16 and fp32, offline throughput (warmed up)
#            and batch-1 TPOT (benchmarks/tp_check.py $CHECK_ARGS; add --symm-off-too for the
#            NCCL-only twin in the same call);
#   profile: where a TP=2 decode step's time goes on rank 0's GPU, fused path vs NCCL only, at
#            batch 1 and 256 (benchmarks/probes/tp_profile.py: the collectives as they cost in the step;
#            PROF_RUNS="1 2 2:KEY=VAL" runs those TP sizes / settings instead);
#   tests:   the other GPU tests of tests/test_tp.py.
# NVLink multicast stays off (the device's own settings; the engine defaults it off as well).
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH
STAGES=${STAGES:-symm comm check profile tests}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u
  python -c 'import torch, triton; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version(), "triton", triton.__version__)'
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM|NANOSERVE)" ; } > "$OUT/device.txt" 2>&1
for stage in $STAGES; do
  echo "== $stage $(date -u +%T)"
  case $stage in
    symm) python tests/hopper_compile.py 2 4 8 > "$OUT/tp_compile.log" 2>&1; echo "kernels compile for sm_90 at: $(tr '\n' ' ' < "$OUT/tp_compile.log" | tail -c 300)"
          timeout "${T_SYMM:-90}" python -m pytest -m gpu tests/test_tp.py tests/test_decode_kernels.py -k "fused_all_reduce or dispatch_matches or replay_chain" -q -s -p no:cacheprovider \
            > "$OUT/tp_symm_test.log" 2>&1; tail -n 3 "$OUT/tp_symm_test.log" ;;
    comm) timeout "${T_COMM:-90}" python benchmarks/probes/tp_comm.py > "$OUT/tp_comm.log" 2>&1; tail -n 24 "$OUT/tp_comm.log" ;;
    check) timeout "${T_CHECK:-380}" python benchmarks/tp_check.py --model "${MODEL:-llama-3.1-8b}" --tp ${TP:-2} $CHECK_ARGS \
            > "$OUT/tp_check.log" 2>&1
          grep -v -e "capturing decode graphs" -e "Warning" -e "warnings.warn" "$OUT/tp_check.log" | tail -n 45 ;;
    profile) timeout "${T_PROF:-150}" python benchmarks/probes/tp_profile.py --tp ${TP:-2} --batches ${PROF_BATCHES:-1 256} ${PROF_RUNS:+--runs $PROF_RUNS} > "$OUT/tp_profile.log" 2>&1
          grep -A12 "== summary" "$OUT/tp_profile.log" ;;
    tests) timeout "${T_TEST:-100}" python -m pytest -m gpu tests/test_tp.py -k "not fused_all_reduce" -q -s -p no:cacheprovider \
            > "$OUT/tp_gpu_tests.log" 2>&1; tail -n 8 "$OUT/tp_gpu_tests.log" ;;
  esac
done
echo "== end $(date -u +%T)"
