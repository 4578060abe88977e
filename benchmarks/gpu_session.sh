#!/bin/bash
# One device call: the GPU tests and benchmarks named in $STAGES, in order; everything goes
# to $OUT/session.log (the device tool returns at most 8 files).
#   STAGES="offline llama latency prefill prefix tests" bash benchmarks/gpu_session.sh
#   STAGES=serving SERVE_RATES=16,32,inf SERVE_POLICIES=mixed [SERVE_ARGS="--num-prompts 50"] [SERVER_ARGS="--max-queued-requests 64"] bash benchmarks/gpu_session.sh
#   STAGES=overload OVERLOAD_PROMPTS="200 300 600" OVERLOAD_VARIANTS="default|--burst-start 2|--burst-max-running 32|--growth 1" bash benchmarks/gpu_session.sh
#   STAGES=structured REPEAT=10 [STRUCTURED_ARGS="--passes 3"] bash benchmarks/gpu_session.sh;  STAGES=soak [SOAK_S=480] bash benchmarks/gpu_session.sh
#   9 minutes over two calls: STAGES=soak_start SOAK_S=540 bash benchmarks/gpu_session.sh, then STAGES=soak_collect bash benchmarks/gpu_session.sh
# Wheels the image lacks travel in .whl/ (carry ".whl", install as ../shared/gpu/wheels.sh prints): after
# `bash ../shared/gpu/wheels.sh`, also `cp /opt/pypi/files/fla_core-0.5.2-py3-none-any.whl
# /opt/pypi/files/einops-0.8.2-py3-none-any.whl .whl/` (the `gpu` extra: Qwen3.5's prefill through fla-core;
# without them the torch twin runs and tests/test_gpu_fla.py skips). Qwen3.5 with fla, one device call each:
#   STAGES=tests_fla bash benchmarks/gpu_session.sh;  STAGES=offline_qwen35 bash benchmarks/gpu_session.sh
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PYTHONPATH
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
LOG=$OUT/session.log
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git rev-parse HEAD; git status --short | head; date -u; } >> $LOG 2>&1
stage() {  # name, timeout in s, command...
  local name=$1 limit=$2; shift 2
  echo "===== $name: $* ($(date -u +%H:%M:%S))" >> $LOG
  local t0=$SECONDS
  timeout $limit "$@" >> $LOG 2>&1
  echo "===== $name rc=$? in $((SECONDS - t0)) s" >> $LOG
}
serve_sweep() {  # policy: a dummy $SERVE_MODEL server, swept at $SERVE_RATES; JSON and PNG to $OUT
  local policy=$1 port=$((8100 + RANDOM % 800)) t0=$SECONDS
  echo "===== serving[$policy]: $SERVE_MODEL at ${SERVE_RATES:-4,8,16,32,inf} req/s ($(date -u +%H:%M:%S))" >> $LOG
  python -m nanoserve serve $SERVE_MODEL --load-format dummy --schedule-policy $policy --port $port $SERVER_ARGS \
    > $OUT/server_$policy.log 2>&1 &
  local pid=$!
  local health="import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)"
  until python -c "$health" http://127.0.0.1:$port/health 2> /dev/null; do  # start-up: weights, warm-up, graphs
    kill -0 $pid 2> /dev/null && [ $((SECONDS - t0)) -lt 240 ] || { tail -20 $OUT/server_$policy.log >> $LOG; kill $pid; return; }
    sleep 2
  done
  timeout ${T_SERVING:-400} python benchmarks/serving.py --base-url http://127.0.0.1:$port --dataset random \
    --random-input-len 1024 --random-output-len 256 --num-prompts 200 --request-rate ${SERVE_RATES:-4,8,16,32,inf} \
    --goodput 500,25 --goodput-steps 0 $SERVE_ARGS --output-json $OUT/serving_$policy.json --output-png $OUT/serving_$policy.png >> $LOG 2>&1
  local rc=$?
  kill $pid; wait $pid
  echo "===== serving[$policy] rc=$rc in $((SECONDS - t0)) s" >> $LOG
}
soak_args() {  # the GPU soak's arguments, its files into $1
  echo --model ${SOAK_MODEL:-smollm2-135m} --duration ${SOAK_S:-480} --cycle ${SOAK_CYCLE:-60} --rate ${SOAK_RATE:-30} \
    --burst ${SOAK_BURST:-400} --max-tokens 64 --max-num-seqs 128 --max-queued-requests 128 --queue-timeout 20 \
    --output-json $1/soak.json --output-png $1/soak.png --server-log $1/soak_server.log
}
soak_wait() {  # until the detached soak is done (or $1 s), then its files to $OUT and its report to the log
  local t0=$SECONDS
  until [ -f /tmp/soak/done ] || [ $((SECONDS - t0)) -ge $1 ]; do sleep 1; done
  cp /tmp/soak/* $OUT/ 2> /dev/null
  echo "===== soak: $([ -f /tmp/soak/done ] && echo "done, rc=$(cat /tmp/soak/done)" || echo "still running") after $((SECONDS - t0)) s" >> $LOG
  tail -25 /tmp/soak/soak.out >> $LOG 2> /dev/null
}
SERVE_MODEL=${SERVE_MODEL:-llama-3.1-8b}
for s in ${STAGES:-tests offline latency}; do
  case $s in
    tests) stage tests 300 python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_gpu_fastpath.py tests/test_piecewise_graph.py ;;
    tests_kernels) stage tests_kernels 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_decode_kernels.py ;;
    tests_attn) stage tests_attn 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_triton_attention.py ;;
    tests_tp_graphs) stage tests_tp_graphs 240 python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_tp.py -k decode_graphs_match_eager ;;  # 2 GPUs
    agree) stage agree ${T_AGREE:-400} python benchmarks/probes/greedy_agreement.py ;;
    offline) stage offline 150 python benchmarks/offline_throughput.py ;;
    offline_fp8) stage offline_fp8 150 python benchmarks/offline_throughput.py --kv-cache-dtype fp8 ;;
    offline_nofused) stage offline_nofused 150 env NANOSERVE_FUSED_SAMPLER=0 python benchmarks/offline_throughput.py ;;
    offline_noops) stage offline_noops 150 env NANOSERVE_TRITON_OPS=0 python benchmarks/offline_throughput.py ;;
    llama) stage offline_llama 200 python benchmarks/offline_throughput.py --model llama-3.1-8b ;;
    latency) stage latency 200 python benchmarks/latency.py ;;
    prefill) stage prefill 300 python benchmarks/prefill_graphs.py ;;
    prefix) stage prefix 400 python benchmarks/prefix_cache.py --model qwen3-0.6b --workloads ${PREFIX_WORKLOADS:-shared,random} $PREFIX_ARGS ;;
    prefix_llama) stage prefix_llama 400 python benchmarks/prefix_cache.py --model llama-3.1-8b ;;
    attention) stage attention 200 python benchmarks/attention.py ;;
    ragged) stage ragged ${T_RAGGED:-300} python benchmarks/attention.py --ragged $RAGGED_ARGS ;;
    gemm) stage gemm ${T_GEMM:-360} python benchmarks/probes/gemm_decode.py $GEMM_ARGS ;;
    cascade) stage cascade ${T_CASCADE:-200} python benchmarks/probes/cascade_decode.py $CASCADE_ARGS ;;
    tests_cascade) stage tests_cascade 300 python -m pytest -m gpu -q -p no:cacheprovider tests/test_cascade.py ;;
    prefix_nocascade) stage prefix_nocascade 300 python benchmarks/prefix_cache.py --model qwen3-0.6b --workloads shared --modes on --no-cascade ;;
    peer) stage peer ${T_PEER:-450} python benchmarks/offline_throughput.py --peer hf ;;
    steps)  # one decode step's graph time per variant: STEP_VARIANTS="A=1,B=0 A=0" (env settings)
      for v in ${STEP_VARIANTS:-default}; do
        stage "steps[$v]" 120 env $(echo "$v" | tr ',' ' ' | sed 's/^default$//') python benchmarks/probes/microbatch_overlap.py --whole
      done ;;
    latency_qwen) stage latency_qwen 120 python benchmarks/latency.py --models qwen3-0.6b ;;
    tests_window) stage tests_window 240 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_window_pages.py ;;
    long_context) stage long_context ${T_LONG:-300} python benchmarks/long_context.py $LONG_ARGS ;;
    long_context_keep) stage long_context_keep ${T_LONG:-300} python benchmarks/long_context.py --keep-pages $LONG_ARGS ;;
    tests_linear) stage tests_linear 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_linear_attention.py ;;
    tests_fla) stage tests_fla 540 python -m pytest -m gpu -q -s -rs -p no:cacheprovider tests/test_gpu_fla.py tests/test_gpu_linear_attention.py ;;
    offline_qwen35) stage offline_qwen35 ${T_QWEN35:-400} python benchmarks/offline_throughput.py --model qwen3.5-35b-a3b ;;
    latency_linear) stage latency_linear ${T_LINEAR:-300} python benchmarks/latency.py --models qwen3.5-9b qwen3.5-35b-a3b --repeats 2 ;;
    tests_fp8_moe) stage tests_fp8_moe ${T_FP8_MOE:-300} python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_moe_kernel.py tests/test_fp8_moe.py -k fp8 ;;
    tests_gpt_oss) stage tests_gpt_oss ${T_GPT_OSS:-200} python -m pytest -m gpu -q -s -p no:cacheprovider tests/test_moe_kernel.py tests/test_gpu_window_pages.py -k "gpt_oss" ;;
    latency_gpt_oss)  # batch-1 decode of gpt-oss-20b (dummy, bf16 experts), the torch sum over every expert against the fused kernels
      stage latency_gpt_oss 200 python benchmarks/latency.py --models gpt-oss-20b --repeats 2
      stage latency_gpt_oss_fused 200 env NANOSERVE_FUSED_GPT_OSS=1 python benchmarks/latency.py --models gpt-oss-20b --repeats 2 ;;
    moe_fp8)  # the fused MoE layer at batch sizes 1-1024, bf16 experts, then e4m3 ones (128x128 blocks)
      stage moe_bf16 120 python benchmarks/moe.py --models qwen3-30b-a3b --tokens 1 8 64 1024 --no-ref
      stage moe_fp8 120 python benchmarks/moe.py --models qwen3-30b-a3b --tokens 1 8 64 1024 --no-ref --fp8 ;;
    moe_mxfp4)  # gpt-oss-20b's expert layer at few tokens, bf16 experts then MXFP4 ones (TUNED_MXFP4 or its fallback)
      stage moe_gpt_oss_bf16 150 python benchmarks/moe.py --models gpt-oss-20b --tokens ${MOE_TOKENS:-1 8} --no-ref
      stage moe_gpt_oss_mxfp4 150 python benchmarks/moe.py --models gpt-oss-20b --tokens ${MOE_TOKENS:-1 8} --no-ref --mxfp4 ;;
    tune_mxfp4) stage tune_mxfp4 ${T_TUNE:-420} python benchmarks/moe.py --models gpt-oss-20b --mxfp4 --tune --tokens ${MOE_TOKENS:-1 2 4 8} ;;
    latency_mxfp4) stage latency_mxfp4 200 env NANOSERVE_MXFP4_EXPERTS=1 python benchmarks/latency.py --models gpt-oss-20b --repeats 2 ;;
    tests_spec) stage tests_spec 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_speculative.py tests/test_gpu_eagle3.py ;;
    tests_runs) stage tests_runs 200 python -m pytest -m gpu -q -p no:cacheprovider tests/test_speculative.py tests/test_triton_attention.py -k "runs or decode or identity" ;;  # decode over runs and per request
    spec_real) stage spec_real ${T_SPEC:-300} python benchmarks/speculative.py --real --gate --phases ;;  # needs the SmolLM2 wheel (../shared/gpu/smollm2_halves.sh)
    verify_cost)  # a verify step's forward against a decode step's: llama-3.1-8b K=4, SmolLM2-135M at the n-gram K of 12
      stage verify_cost 200 python benchmarks/speculative.py --verify-cost $VERIFY_ARGS
      stage verify_cost_smollm2 120 python benchmarks/speculative.py --verify-cost --verify-model smollm2-135m --verify-k 12 --verify-batches 1 4 ;;
    eagle3) stage eagle3 150 python benchmarks/probes/eagle3_step.py --model llama-3.1-8b --draft-vocab 32000 --k 4 ;;
    profile) stage profile 400 python benchmarks/probes/profile_offline.py ;;
    host) stage host ${T_HOST:-200} python benchmarks/probes/host_overhead.py --model ${HOST_MODEL:-qwen3-0.6b} $HOST_ARGS ;;
    spread) stage spread 300 python benchmarks/offline_throughput.py --repeat ${REPEAT:-4} ;;
    overload)  # the engine's loop under Poisson arrivals, every step traced (probes/overload_steps.py)
      IFS='|' read -ra variants <<< "${OVERLOAD_VARIANTS:-default}"
      for n in ${OVERLOAD_PROMPTS:-200 300 600}; do
        for v in "${variants[@]}"; do
          stage "overload[$n, $v]" ${T_OVERLOAD:-240} python benchmarks/probes/overload_steps.py --model $SERVE_MODEL \
            --rate ${OVERLOAD_RATE:-32} --num-prompts $n $(echo "$v" | sed 's/^default$//')
        done
      done ;;
    server_steps)  # the served engine's own token times against the client's (probes/server_steps.py)
      stage server_steps ${T_SERVER_STEPS:-200} python benchmarks/probes/server_steps.py --runs ${SERVER_STEPS_RUNS:-32x200 32x300} --trace $OUT/server_steps.json ;;
    structured)  # with the GPU's clocks, power and temperature every 100 ms (UTC), to line up with each round's profile
      nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu \
        --format=csv -lms 100 > $OUT/gpu_clocks.csv 2>&1 &
      smi_pid=$!
      stage structured ${T_STRUCTURED:-580} python benchmarks/structured.py --repeat ${REPEAT:-10} --no-max-length --profile-rounds $STRUCTURED_ARGS
      kill $smi_pid ;;
    soak)  # a server under the changing mix for SOAK_S seconds of load (benchmarks/soak.py); JSON and PNG to $OUT.
      # Start-up comes on top: 42-62 s for smollm2-135m (2026-12-02), so a 600 s call holds 480 s of load
      stage soak $(( ${SOAK_S:-480} + 110 )) python benchmarks/soak.py $(soak_args $OUT) ;;
    soak_start)  # the 9-minute soak (SOAK_S=540), which outlives one call: started in a session of its own, waited
      # for up to SOAK_WAIT s; then `STAGES=soak_collect` in the next call, made at once (a machine idles out after 30 s)
      mkdir -p /tmp/soak && rm -f /tmp/soak/done
      setsid nohup bash -c "python benchmarks/soak.py $(soak_args /tmp/soak) > /tmp/soak/soak.out 2>&1; echo \$? > /tmp/soak/done" \
        < /dev/null > /dev/null 2>&1 &
      soak_wait ${SOAK_WAIT:-555} ;;
    soak_collect) soak_wait ${SOAK_WAIT:-150} ;;
    serving) for p in ${SERVE_POLICIES:-mixed prefill-first}; do serve_sweep $p; done ;;  # needs .whl: the default set plus xgrammar
    sampler) stage sampler_tests ${T_SAMPLER_TESTS:-300} python -m pytest -m gpu -q -p no:cacheprovider tests/test_sampler.py
             stage sampler_bench 120 python benchmarks/probes/sampler_bench.py ;;
  esac
done
grep -E "^=====|^cycle |^\[ok\]|^\[FAIL\]|tok/s|TPOT|passed|failed|error|identical|x$|skipped|SKIPPED|Gated DeltaNet prefill|fla vs twin|relative:" $LOG | tail -n 90
