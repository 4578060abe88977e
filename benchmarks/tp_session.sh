#!/bin/bash
# One device call on nvidia-h200-x2 for tensor parallelism (issue 7), logs under $OUT:
#   1. the symmetric-memory all-reduce against NCCL's on both GPUs (GPU test, a few seconds);
#   2. TP=2 vs TP=1: greedy agreement in bf16 and fp32, offline throughput (warmed up) and
#      batch-1 TPOT, with the decode sums over symmetric memory and, last, with NCCL only
#      (NANOSERVE_SYMM_MEM=0);
#   3. where a TP=2 decode step's time goes on rank 0's GPU, symmetric memory vs NCCL only, at
#      batch 1 and 256 (benchmarks/tp_profile.py: the collectives as they cost inside the step);
#   4. the communication costs alone (benchmarks/tp_comm.py);
#   5. the other GPU tests of tests/test_tp.py.
# Each stage has its own time limit (T_* seconds), so one that hangs leaves the others their time.
# NVLink multicast stays off (the device's own settings; the engine defaults it off as well).
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1
export NANOSERVE_SYMM_MEM=${NANOSERVE_SYMM_MEM:-1}  # the opt-in path is the one measured first here
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u
  python -c 'import torch; print("torch", torch.__version__, "NCCL", torch.cuda.nccl.version())'
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" ; } > "$OUT/device.txt" 2>&1
timeout "${T_SYMM:-60}" python -m pytest -m gpu tests/test_tp.py -k symm -q -s -p no:cacheprovider \
  > "$OUT/tp_symm_test.log" 2>&1
tail -n 3 "$OUT/tp_symm_test.log"
timeout "${T_CHECK:-380}" python benchmarks/tp_check.py --model "${MODEL:-llama-3.1-8b}" --tp 2 --symm-off-too \
  $CHECK_ARGS > "$OUT/tp_check.log" 2>&1
grep -v -e "capturing decode graphs" -e "Warning" -e "warnings.warn" "$OUT/tp_check.log" | tail -n 45
timeout "${T_PROF:-120}" python benchmarks/tp_profile.py --batches 1 256 > "$OUT/tp_profile.log" 2>&1
grep -A3 "== summary" "$OUT/tp_profile.log"
timeout "${T_COMM:-60}" python benchmarks/tp_comm.py > "$OUT/tp_comm.log" 2>&1
tail -n 24 "$OUT/tp_comm.log"
timeout "${T_TEST:-100}" python -m pytest -m gpu tests/test_tp.py -k "not symm" -q -s -p no:cacheprovider \
  > "$OUT/tp_gpu_tests.log" 2>&1
tail -n 8 "$OUT/tp_gpu_tests.log"
