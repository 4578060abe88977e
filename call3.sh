#!/bin/bash
export PYTHONUNBUFFERED=1
L=$OUT/call.log
s() { local n=$1 t=$2; shift 2; echo "===== $n ($(date -u +%T))" >> $L; local t0=$SECONDS; timeout $t "$@" >> $L 2>&1; echo "===== $n rc=$? in $((SECONDS-t0)) s" >> $L; }
git log --oneline -1 >> $L 2>&1
s tests 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_kernel.py tests/test_gpu_window_pages.py -k "mxfp4 or gpt_oss"
s moe 60 python benchmarks/moe.py --models gpt-oss-20b --tokens 1 2 4 8 --no-ref --mxfp4
s latency 100 env NANOSERVE_MXFP4_EXPERTS=1 python benchmarks/latency.py --models gpt-oss-20b --repeats 2
s offline 180 env NANOSERVE_MXFP4_EXPERTS=1 python benchmarks/offline_throughput.py --model gpt-oss-20b
