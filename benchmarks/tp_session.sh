#!/bin/bash
# One device call on nvidia-h200-x2 for tensor parallelism (issue 7): TP=2 vs TP=1 check and
# speed, the communication costs, then the GPU tests of tests/test_tp.py; logs under $OUT.
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PYTHONPATH
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nvidia-smi topo -m; date -u
  env | grep -E "^(NCCL|TORCH_SYMM|NVSHMEM)" ; } > "$OUT/device.txt" 2>&1
timeout "${T_CHECK:-400}" python benchmarks/tp_check.py --model "${MODEL:-llama-3.1-8b}" --tp 2 $CHECK_ARGS 2>&1 \
  | tee "$OUT/tp_check.log"
timeout "${T_COMM:-50}" python benchmarks/tp_comm.py 2>&1 | tee "$OUT/tp_comm.log"
timeout "${T_TEST:-80}" python -m pytest -m gpu tests/test_tp.py -q -s -p no:cacheprovider > "$OUT/tp_gpu_tests.log" 2>&1
tail -n 12 "$OUT/tp_gpu_tests.log"
