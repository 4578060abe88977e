#!/usr/bin/env bash
# One device call: speculative GPU tests, the real-weight benchmark, the EAGLE-3 probe.
export PYTHONPATH=/tmp/site:$PWD:$PYTHONPATH
cat .whl/COMMIT
timeout 150 python3 -m pytest -q -m gpu tests/test_speculative.py tests/test_gpu_eagle3.py 2>&1 | tail -3
timeout 200 python3 benchmarks/speculative.py --real --gate 2>&1 | grep -v -i warn > $OUT/spec.log
tr '\r' '\n' < $OUT/spec.log | grep -a -E "^(real|ngram|verify cost)|Error"
timeout 100 python3 benchmarks/probes/eagle3_step.py --model llama-3.1-8b --draft-vocab 32000 --k 4 2>&1 | grep -v -i warn | tr '\r' '\n' | grep -v "it/s" | tail -8
