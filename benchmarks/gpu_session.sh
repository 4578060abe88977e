#!/bin/bash
# One device call: GPU tests, then the benchmarks; logs under $OUT (issue 5).
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > $OUT/device.txt 2>&1
git rev-parse HEAD >> $OUT/device.txt 2>/dev/null; date -u >> $OUT/device.txt
export PYTHONPATH=$PWD:$PYTHONPATH
STAGES=${STAGES:-"tests offline latency"}
for stage in $STAGES; do
  case $stage in
    tests) timeout ${T_TESTS:-240} python -m pytest -m gpu tests/test_gpu_fastpath.py -q -s -p no:cacheprovider > $OUT/gpu_tests.log 2>&1; echo "tests rc=$?" >> $OUT/gpu_tests.log ;;
    offline) timeout ${T_OFFLINE:-150} python benchmarks/offline_throughput.py $OFFLINE_ARGS > $OUT/offline.log 2>&1; echo "offline rc=$?" >> $OUT/offline.log ;;
    offline_eager) timeout 150 python benchmarks/offline_throughput.py --enforce-eager --no-overlap > $OUT/offline_eager.log 2>&1 ;;
    latency) timeout ${T_LAT:-150} python benchmarks/latency.py > $OUT/latency.log 2>&1; echo "latency rc=$?" >> $OUT/latency.log ;;
    profile) timeout 200 python benchmarks/profile_decode.py > $OUT/profile.log 2>&1 ;;
    peer) timeout ${T_PEER:-300} python benchmarks/offline_throughput.py --peer hf > $OUT/offline_peer.log 2>&1 ;;
  esac
  for f in $OUT/*.log; do tail -n 4 $f; done
done
