#!/usr/bin/env bash
# One GPU session's measurements, run in the background on the device machine so that consecutive device
# calls can pick up where the last one stopped (the machine stays warm between calls made within seconds).
#
#   bash bench/gpu_session.sh start PHASE...   # starts the phases, in order, detached (setsid)
#   bash bench/gpu_session.sh start next       # the measurements still owed (see the `next` list below)
#   bash bench/gpu_session.sh wait SECONDS     # waits until they are done or SECONDS pass; copies results to $OUT
#
# Phases are the functions `phase_*` below; each has its own time limit, so one hang cannot eat the session.
# Results: $GS/results.jsonl (JSON lines of every benchmark), one log per phase, $GS/session.log.
set -u
GS=${GS:-/tmp/gs}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
RES=$GS/results.jsonl

limit() {  # limit SECONDS cmd...: the command in a process group of its own, which is ended (spawned
    # workers and compile workers included) after SECONDS or when the command returns
    setsid timeout -k 15 "$@" &
    local pid=$! rc
    wait $pid
    rc=$?
    kill -9 -- -"$pid" 2>/dev/null
    return $rc
}

phase_tests_all() { limit 560 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore --durations=15 tests/; }
phase_tests_rollout() { limit 300 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore tests/test_rollout_fast.py; }
phase_tests_engine() { limit 300 python3 -m pytest -q -p no:cacheprovider -W ignore --durations=5 tests/test_engine_gpu.py; }
phase_profile() { limit 240 python3 bench/profile_step.py --rows "${PROFILE_ROWS:-plain_4,fsdp2_4,fsdp2_4_compile}"; }
phase_profile2() { limit 240 python3 bench/profile_step.py --world 2 --rows "${PROFILE2_ROWS:-fsdp2_4_compile,fsdp2_8_compile}"; }
phase_profile_decode() { limit 400 python3 bench/profile_decode.py --out $RES; }
phase_engine1() { limit 300 python3 bench/engine.py --world 1 --steps 3 --out $RES \
    --rows "${ENGINE1_ROWS:-plain_4,fsdp2_4,fsdp2_4_compile,fsdp2_4_z2_compile,fsdp2_8_compile}"; }
phase_engine2() { limit 240 python3 bench/engine.py --world 2 --steps 3 --out $RES \
    --rows "${ENGINE2_ROWS:-plain_4,fsdp2_4,fsdp2_4_compile,fsdp1_4}"; }
phase_greedy() { limit 200 python3 bench/rollout.py --cases greedy_64 --new-tokens 64 --out $RES; }
phase_greedy_confident() { for std in ${GREEDY_STDS:-0.05 0.1}; do
    limit 150 python3 bench/rollout.py --cases greedy_64 --new-tokens 64 --init-std $std --out $RES; done; }
phase_rollout256() { limit 300 python3 bench/rollout.py --cases fixed_256 --rows "${ROLLOUT256_ROWS:-hf_dynamic,fast,hf_static}" \
    --out $RES; }
phase_rollout() { limit 420 python3 bench/rollout.py --cases "${ROLLOUT_CASES:-fixed_64,mixed}" --hf-warm-once \
    --rows "${ROLLOUT_ROWS:-hf_dynamic,fast}" --out $RES; }
phase_state1() { limit 200 python3 bench/state.py --world 1 --strategies fsdp2,fsdp --out $RES; }
phase_state2() { limit 200 python3 bench/state.py --world 2 --strategies "${STATE_STRATEGIES:-fsdp2,fsdp}" --out $RES; }
phase_ulysses() { limit 360 python3 bench/ulysses.py --world 2 --sp "${ULYSSES_SP:-1,2}" --out $RES \
    ${ULYSSES_LENGTHS:+--lengths $ULYSSES_LENGTHS} --steps "${ULYSSES_STEPS:-2}"; }
# the whole-step benchmark against TRL (issue 14); TRL's wheels installed under /tmp/site by the caller
phase_e2e_prepare() { limit 240 python3 bench/e2e.py --root /tmp/e2e --systems none; }
phase_e2e_shardrl1() {  # shardrl on one GPU, every case; then the demo's profile on the GPU and the CPU
    limit 560 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 5 --out $RES
    limit 150 python3 bench/profile_demo.py --device cuda --steps 30 --out $RES
    limit 100 python3 bench/profile_demo.py --device cpu --steps 30 --out $RES
}
phase_e2e_trl() {  # TRL on one GPU (its wheels under /tmp/site); the variable-length case: one step after warm-up
    PYTHONPATH=/tmp/site:$PWD limit 300 python3 bench/e2e.py --root /tmp/e2e --systems trl --cases fixed_64,fixed_512 \
        --trl-steps 3 --out $RES
    PYTHONPATH=/tmp/site:$PWD limit 400 python3 bench/e2e.py --root /tmp/e2e --systems trl --cases var_512 \
        --trl-steps 2 --out $RES
}
phase_e2e2() {  # shardrl alone on two GPUs: 50 steps at 512 samples (drift), the variable lengths, offload
    limit 420 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases fixed_512 --steps 50 \
        --tag drift --out $RES
    limit 200 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases var_512 --steps 5 --out $RES
    limit 200 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases fixed_512 --steps 4 \
        --tag offload --extra "actor.engine.offload_params=true actor.engine.offload_optimizer=true" --out $RES
}
# the fast rollout's model families (issue 21) and the rollout-mismatch correction (issue 16), one H200
phase_fam_tests() { limit 240 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore tests/test_rollout_fast_families.py \
    tests/test_rollout_fast.py; }
phase_fam_bench() { limit 330 python3 bench/rollout_families.py --out $RES; }
phase_mismatch() { limit 240 python3 bench/rollout_mismatch.py --steps 80 --root /tmp/mismatch; }
# the last calls of issue 14's session: two GPUs, compile on, the demo's step after the attention fix, GPU tests
phase_e2e_final() {
    limit 200 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases fixed_512 --steps 8 --out $RES
    limit 150 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases var_512 --steps 4 --out $RES
    limit 150 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 2 --cases fixed_512 --steps 3 \
        --tag offload --extra "actor.engine.offload_params=true actor.engine.offload_optimizer=true" --out $RES
    CUDA_VISIBLE_DEVICES=0 limit 200 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --cases fixed_512 \
        --steps 5 --tag compile --extra "actor.engine.compile=true" --no-floor --out $RES
    CUDA_VISIBLE_DEVICES=0 limit 100 python3 bench/profile_demo.py --device cuda --steps 30 --top 15 --out $RES
}
phase_tests_final() { limit 200 python3 -m pytest -q -p no:cacheprovider -W ignore tests/test_sharded_load.py \
    tests/test_engine_gpu.py tests/test_step_metrics.py -k "sharded or gpu or fsdp1 or cuda"; }
phase_drift() { CUDA_VISIBLE_DEVICES=0 limit 200 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 \
    --cases fixed_64 --steps 50 --tag drift --no-floor --out $RES; }
phase_startup() { limit 240 python3 bench/startup.py --cases 1.5b:1,1.5b:2 --out $RES; }
# session 4: what issues 14, 17, 18 and 19 still owed a GPU
phase_s4_single() {  # two single-GPU streams at once. GPU 0: the e2e models, then the 50-step drift run;
    # GPU 1: the GPU tests new since the last GPU session, then the multi-turn rollout's throughput
    ( export CUDA_VISIBLE_DEVICES=0
      limit 240 python3 bench/e2e.py --root /tmp/e2e --systems none > "$GS/s4_prepare.log" 2>&1
      limit 260 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --cases fixed_64 --steps 50 \
          --tag drift --no-floor --out $RES > "$GS/s4_drift.log" 2>&1 ) &
    local gpu0=$!
    ( export CUDA_VISIBLE_DEVICES=1
      limit 300 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_attention.py \
          tests/test_rollout_fast.py tests/test_rollout_fast_families.py tests/test_logprob.py > "$GS/s4_tests.log" 2>&1
      for latency in 0 0.2; do
          limit 150 python3 bench/multiturn.py --backend fast --shape 0.5b --prompts 128 --n 4 \
              --tool-latency-s $latency 2>&1 | tee -a "$GS/s4_multiturn.log" | grep '^{' >> $RES
      done ) &
    wait $gpu0 $!
}
phase_s4_async() {  # issue 18: the variable-length case on two GPUs, colocated against disaggregated 1 + 1
    local B="python3 bench/e2e.py --root /tmp/e2e --cases var_512 --systems shardrl --gpus 2 --steps 8 --no-floor --out $RES"
    local A="async_rl.rollout_ranks=1 algorithm.rollout_is=true"
    limit 220 $B --tag sync2
    limit 220 $B --tag async1 --extra "$A async_rl.max_staleness=1"
    limit 220 $B --tag async2 --extra "$A async_rl.max_staleness=2"
    limit 220 $B --tag async2_partial --extra "$A async_rl.max_staleness=2 async_rl.partial_rollout=true"
}
phase_s4_multi() {  # issues 18 and 17 on two GPUs: the NCCL weight stream's test, start-up, the engine's 2-GPU rows
    limit 200 python3 -m pytest -q -p no:cacheprovider -W ignore -rs tests/test_async_rl.py -k nccl
    limit 300 python3 bench/startup.py --cases 1.5b:1,1.5b:2,7b:2 --out $RES
    limit 240 python3 bench/engine.py --world 2 --steps 3 --out $RES \
        --rows fsdp2_8,hsdp1_8,fsdp2_8_compile,hsdp1_8_compile,fsdp2_8_z2_compile
}
phase_s4_profile() {  # the 2-GPU engine row against one GPU, per phase (issue 17 part 5)
    CUDA_VISIBLE_DEVICES=0 limit 150 python3 bench/profile_step.py --rows fsdp2_8_compile
    limit 150 python3 bench/profile_step.py --world 2 --rows fsdp2_8_compile
}
# session 5 (its first run, phases s5_* at commit 71860cd, lost its machine during s5_multi): the entropy in
# the update's forward moved to a fused function (`_ChunkLogProbEntropy`); its GPU tests and head benchmark
# run on GPU 1 while GPU 0's process writes the e2e models; then the async rows, the NCCL test, and issue 17's runs
phase_s6_prepare() {
    ( CUDA_VISIBLE_DEVICES=0 limit 240 python3 bench/e2e.py --root /tmp/e2e --systems none ) &
    local prep=$!
    ( export CUDA_VISIBLE_DEVICES=1
      limit 120 python3 bench/logprob.py --out $RES > "$GS/s6_logprob.log" 2>&1
      limit 150 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_logprob.py \
          > "$GS/s6_tests.log" 2>&1 ) &
    wait $prep $!
}
phase_s6_async() {
    local B="python3 bench/e2e.py --root /tmp/e2e --cases var_512 --systems shardrl --gpus 2 --steps 6 --no-floor --out $RES"
    local A="async_rl.rollout_ranks=1 algorithm.rollout_is=true"
    limit 200 $B --tag sync2
    limit 200 $B --tag async2 --extra "$A async_rl.max_staleness=2"
    limit 150 python3 -m pytest -q -p no:cacheprovider -W ignore -rs tests/test_async_rl.py -k nccl
}
phase_s6_multi() {
    limit 150 python3 bench/profile_step.py --world 2 --rows fsdp2_8_compile
    limit 240 python3 bench/startup.py --cases 1.5b:2,7b:2 --out $RES
    limit 300 python3 bench/engine.py --world 2 --steps 3 --out $RES \
        --rows fsdp2_8,hsdp1_8,fsdp2_8_compile,hsdp1_8_compile,fsdp2_8_z2_compile
    limit 200 python3 bench/e2e.py --root /tmp/e2e --cases var_512 --systems shardrl --gpus 2 --steps 6 --no-floor \
        --out $RES --tag async1 --extra "async_rl.rollout_ranks=1 algorithm.rollout_is=true async_rl.max_staleness=1"
}
# owed to the next session (one H200 each stream): issue 19's overlapped tools against rounds on the GPU,
# issue 14's one-GPU cases again after the fused entropy (TRL's wheels under /tmp/site; e2e_prepare first)
phase_s7_multiturn() {
    for flags in "" "--overlap-tools"; do
        for latency in 0 0.2; do
            limit 200 python3 bench/multiturn.py --backend fast --shape 0.5b --prompts 128 --n 4 \
                --tool-latency-s $latency --tool-latency-spread 1.0 --num-tool-workers 64 $flags | grep '^{' >> $RES
        done
    done
}
phase_s7_e2e1() { CUDA_VISIBLE_DEVICES=0 limit 500 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 \
    --steps 5 --out $RES; }

# session 6 (one H200): the fast rollout's compaction (GPU tests, the tail case with and without), issue 14's
# one-GPU cases after the fused entropy and the compaction, TRL in the same session (wheels under /tmp/site)
phase_s8_tests() { limit 240 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_rollout_fast.py; }
phase_s8_rollout() { limit 240 python3 bench/rollout.py --cases tail_512 --rows fast_no_compact,fast --out $RES; }
phase_s8_e2e1() { limit 560 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 4 --no-floor --out $RES; }
phase_s8_trl() {
    PYTHONPATH=/tmp/site:$PWD limit 240 python3 bench/e2e.py --root /tmp/e2e --systems trl --cases fixed_64,fixed_512 \
        --trl-steps 3 --out $RES
    PYTHONPATH=/tmp/site:$PWD limit 330 python3 bench/e2e.py --root /tmp/e2e --systems trl --cases var_512 \
        --trl-steps 2 --out $RES
}
phase_s8_e2e_keep() {  # the rollout's cache kept through the update (free_cache_engine null -> false here) and freed
    local B="python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 5 --no-floor --out $RES"
    limit 300 $B --tag keep
    limit 200 $B --cases fixed_512,var_512 --tag free --extra "rollout.free_cache_engine=true"
}
phase_s8_tools() {  # issue 19: the tools example on the GPU (the GGUF's two parts under /tmp/smollm2_parts)
    STEPS=${TOOLS_STEPS:-30} TRAIN_LIMIT_S=420 bash examples/tools/gpu_run.sh start \
        && bash examples/tools/gpu_run.sh wait 840 > /dev/null
}

# session 7 (one H200): the head on the responses only (engine A/B), compaction in steps of an eighth (A/B against
# session 6's halving), then issue 14's cases again
phase_s9_tests() { limit 300 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_rollout_fast.py \
    tests/test_logprob.py tests/test_attention.py; }
phase_s9_engine() { limit 300 python3 bench/engine.py --world 1 --steps 4 --out $RES \
    --rows "${S9_ENGINE_ROWS:-fsdp2_rl_8_fullhead_compile,fsdp2_rl_8_compile}"; }
phase_s9_profile() { limit 300 python3 bench/profile_step.py \
    --rows "${S9_PROFILE_ROWS:-fsdp2_rl_8_compile,fsdp2_rlvar_compile}"; }
phase_s9_rollout() { limit 240 python3 bench/rollout.py --cases tail_512 --rows fast_halving,fast --out $RES; }
phase_s9_accum() { limit 200 python3 bench/engine.py --world 1 --warmup 2 --steps 2 --out $RES \
    --rows fsdp2_rlvar_sync_compile,fsdp2_rlvar_compile; }
phase_s9_e2e() { limit 560 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 5 \
    --cases "${S9_E2E_CASES:-fixed_64,fixed_512,var_512}" --out $RES; }
# session 8: the policy head's Triton kernels (tests, the head alone, var_512's update), then the whole step
phase_s10_tests() { limit 300 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_logprob.py \
    tests/test_attention.py tests/test_response_head.py; }
phase_s10_logprob() { limit 120 python3 bench/logprob.py --out $RES; }
phase_s10_engine() { limit 330 python3 bench/engine.py --world 1 --warmup 2 --steps 2 --out $RES \
    --rows "${S10_ENGINE_ROWS:-fsdp2_rlvar_ent_headcompiled_compile,fsdp2_rlvar_ent_compile,fsdp2_rlvar_ent_32k_compile}"; }
phase_s10_e2e() {  # the whole step, every case, then 512 samples with micro-batches of 32k tokens
    limit 420 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 5 --out $RES
    limit 300 python3 bench/e2e.py --root /tmp/e2e --systems shardrl --gpus 1 --steps 5 --cases var_512,fixed_512 \
        --tag mb32k --extra actor.engine.max_token_len_per_gpu=32768 --out $RES
}

# session 14 (one H200): issue 32's 7B LoRA step at its least memory, issue 35's mixture-of-experts figures (GPU
# tests, the update against HF's eager experts, the decode against HF generate, router replay), then full
# fine-tuning of the 7B shape with fp32 master weights and the offload it needs, with what time is left
monitor() { while :; do echo "$(date +%T) $(free -g | awk 'NR==2{print "host used " $3 " of " $2 " GiB"}') gpu" \
    "$(nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader)"; sleep 15; done; }
phase_s14_lora() { limit 260 python3 bench/lora.py steps --cases 7b_lora_lowmem,7b_lora_unmerged --steps 4 \
    --case-timeout-s 125 --out $RES; }
phase_s14_moe_tests() { limit 300 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_moe.py \
    tests/test_rollout_fast_families.py; }
phase_s14_moe_update() {
    limit 260 python3 bench/moe.py update --shape olmoe --experts grouped_mm,eager,grouped_mm+compile --out $RES
    limit 260 python3 bench/moe.py update --shape qwen3_30b_a3b --prompts 8 --experts grouped_mm,eager --out $RES
}
phase_s14_moe_rollout() { limit 240 python3 bench/moe.py rollout --shape qwen3_moe_7b --out $RES; }
phase_s14_moe_replay() { limit 300 python3 bench/moe.py replay --shape qwen3_moe_7b --steps 3 --out $RES \
    --extra "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192"; }
phase_s14_fix() {  # after the fixes of the first run: the MoE GPU tests, router replay off and on
    limit 120 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_moe.py \
        tests/test_rollout_fast_families.py -k "moe or mixtral or grouped or replay"
    limit 200 python3 bench/moe.py replay --shape qwen3_moe_7b --steps 3 --out $RES \
        --extra "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192"
}
phase_s14_full7b() {
    monitor > "$GS/monitor.log" 2>&1 &
    local mon=$!
    limit 600 python3 bench/lora.py steps --cases 7b_full --steps 3 --case-timeout-s "${FULL_S:-580}" --out $RES
    kill $mon
}
# session 15's owed measurements (one H200). The `old` tree of the prefix-reuse comparison is the code before the
# paged cache, carried in: `git archive c3addb1 shardrl bench | tar -x -C .baseline_tree` here, then
# carry=[".baseline_tree"] in the device call
phase_s15_tests() { limit 420 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_rollout_fast.py \
    tests/test_rollout_fast_families.py tests/test_prefix_cache.py tests/test_moe.py tests/test_lora.py; }
phase_s15_prefix() { limit 500 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree --shape 1.5b --prompts 32 \
    --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s15_prefix_mt() {  # the multi-turn workload from each tree (each script imports its own tree)
    for tree in . .baseline_tree; do
        limit 300 python3 $tree/bench/multiturn.py --backend fast --shape 0.5b --prompts 256 --n 2
    done
}
phase_s15_serve() { limit 400 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --out $RES; }
phase_s15_lora_gc() { limit 300 python3 bench/lora.py steps --cases 7b_lora_unmerged_gc --steps 4 --out $RES; }
phase_s15_moe() {
    limit 300 python3 bench/moe.py update --shape olmoe --experts grouped_mm --out $RES
    limit 300 python3 bench/moe.py update --shape qwen3_30b_a3b --experts grouped_mm --out $RES
}
# session 17's plan (one H200), what session 16 left: s17_tests s15_serve s16_agent s16_prefix_mt_real s15_lora_gc
# s15_moe. The serve and agent phases need the wheels of bench/pack_server_wheels.sh installed first, the agent the
# GGUF's parts (examples/smollm2/gpu_run.sh pack): part00 with the first call, part01 with the second, at once.
phase_s17_tests() { limit 200 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
    tests/test_serve.py tests/test_agent.py; }
# session 16: the calculator agent (issue 36) from the tools warm start; the GGUF's two parts arrive in two calls
# under /tmp/smollm2_parts (the phase waits for the second), then the multi-turn workload on that model from each tree
phase_s16_agent() {
    local t=0
    while [ ! -f /tmp/smollm2_parts/smollm2.gguf.part01 ] && [ $t -lt 300 ]; do sleep 5; t=$((t + 5)); done
    GR=/tmp/agent_run TRAIN_CONFIG=examples/agent/gpu.yaml STEPS=${AGENT_STEPS:-30} VAL_FREQ=10 BASE_EVAL=0 \
        TRAIN_LIMIT_S=${AGENT_LIMIT_S:-480} bash examples/tools/gpu_run.sh start \
        && GR=/tmp/agent_run bash examples/tools/gpu_run.sh wait 780 > /dev/null
    cp /tmp/agent_run/summary.json "$GS/agent_summary.json" 2>/dev/null
    for f in status seconds train.log warm_eval.log; do cp "/tmp/agent_run/$f" "$GS/agent_$f" 2>/dev/null; done
}
phase_s16_prefix_mt_real() {
    for tree in . .baseline_tree; do
        limit 240 python3 $tree/bench/multiturn.py --backend fast --model /tmp/agent_run/warm_sft/hf_model \
            --data /tmp/agent_run/data/train.jsonl --prompts 64 --n 8 --max-response-tokens 384
    done
}

collect() {
    local out=${OUT:-gpu_out}
    mkdir -p "$out"
    cp "$GS/session.log" "$out/" 2>/dev/null
    cp "$RES" "$out/" 2>/dev/null
    cp "$GS/agent_summary.json" "$out/" 2>/dev/null
    tar czf "$out/logs.tar.gz" -C "$GS" . 2>/dev/null
    echo "---- session"; cat "$GS/session.log"
    echo "---- results"; cat "$RES" 2>/dev/null | cut -c1-400
    for f in "$GS"/*.log; do
        [ "$(basename "$f")" = session.log ] && continue
        echo "---- $(basename "$f") (tail)"; grep -vE "^\s*$" "$f" | grep -E "passed|failed|FAILED|ERROR|Error|error|rc=" | tail -8
    done
}

# session 18 (one H200): the shared-prefix decode (cascade) in the CUDA tests and the long-prompt comparison, with
# the new tree without it and the old tree; then session 17's owed phases:
#   s18_tests s18_prefix s16_agent s18_serve s15_lora_gc s16_prefix_mt_real s18_moe
phase_s18_tests() { limit 300 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
    tests/test_serve.py tests/test_agent.py tests/test_rollout_fast.py; }
phase_s18_serve() {  # the server at Python's default thread switch interval (5 ms) and at 0.5 ms
    limit 300 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --out $RES
    limit 300 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --switch-interval-ms 0.5 --out $RES
}
phase_s18_moe() {  # OLMoE compiled (routers outside the compiled blocks since session 15) against HF's eager experts;
    # Qwen3-30B-A3B with LoRA; router replay R3 against none on the GPU
    limit 300 python3 bench/moe.py update --shape olmoe --experts grouped_mm+compile,eager --out $RES
    limit 420 python3 bench/moe.py update --shape qwen3_30b_a3b --experts grouped_mm+compile,eager --out $RES
    limit 300 python3 bench/moe.py replay --shape qwen3_moe_7b --steps 3 --modes R3,disabled --out $RES \
        --extra "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192"
}
phase_s18_prefix() { limit 520 python3 bench/prefix_reuse.py --trees new=.,flat=.@cascade=0,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }

# next session (one H200): the cascade kernel's launch settings alone, then the long prompts with the best of them;
# the multi-turn prefills profiled; what session 18 did not reach (s18_moe, the LoRA peaks in one measure)
#   s21_cascade s19_prefix s19_mt_profile s18_moe (s19_mt_profile's first half after s16_agent; the kernel's settings
#   alone: bench/profile_cascade.py, which replaced session 19's bench/cascade_kernel.py, never run)
phase_s19_mt_profile() {  # the real multi-turn workload profiled (needs the agent phase's warm start under /tmp)
    limit 300 python3 bench/multiturn.py --backend fast --model /tmp/agent_run/warm_sft/hf_model \
        --data /tmp/agent_run/data/train.jsonl --prompts 64 --n 8 --max-response-tokens 384 --profile
    limit 300 python3 bench/multiturn.py --backend fast --shape 0.5b --prompts 256 --n 2 --profile
}
phase_s19_prefix() { limit 520 python3 bench/prefix_reuse.py \
    --trees ps4=.,ps8=.@prefix_splits=8,ps16=.@prefix_splits=16,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }

# session 19 (one H200): CUDA tests of the tree; the tools warm start alone, then the real multi-turn workload
# (conversations' copies prefilled once, every conversation decoding at once) from each tree, at the trees' own
# slot counts and at 512 for both; MoE (OLMoE's eager baseline, Qwen3-30B-A3B with LoRA, R3); long prompts with more
# prefix splits; the 7B LoRA step's device peak as nvidia-smi counts it (session 14's full fine-tuning figure)
#   s19_tests s19_warm s19_mt s18_moe s19_prefix2 s19_lora_smi
phase_s19_tests() { limit 240 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
    tests/test_rollout_fast.py; }
phase_s19_warm() {
    local t=0
    while [ ! -f /tmp/smollm2_parts/smollm2.gguf.part01 ] && [ $t -lt 300 ]; do sleep 5; t=$((t + 5)); done
    GR=/tmp/agent_run WARM_ONLY=1 BASE_EVAL=0 bash examples/tools/gpu_run.sh start \
        && GR=/tmp/agent_run bash examples/tools/gpu_run.sh wait 400 > /dev/null
    for f in status seconds warm_start.log; do cp "/tmp/agent_run/$f" "$GS/warm_$f" 2>/dev/null; done
}
phase_s19_mt() {  # JSON lines in the phase's log
    local real="--backend fast --model /tmp/agent_run/warm_sft/hf_model --data /tmp/agent_run/data/train.jsonl \
        --prompts 64 --n 8 --max-response-tokens 384"
    limit 200 python3 bench/multiturn.py $real
    limit 200 python3 .baseline_tree/bench/multiturn.py $real
    limit 200 python3 .baseline_tree/bench/multiturn.py $real --max-batch 512
    limit 150 python3 bench/multiturn.py $real --profile
    limit 200 python3 bench/multiturn.py --backend fast --shape 0.5b --prompts 256 --n 2 --max-batch 512
    limit 200 python3 .baseline_tree/bench/multiturn.py --backend fast --shape 0.5b --prompts 256 --n 2 --max-batch 512
}
phase_s19_prefix2() { limit 420 python3 bench/prefix_reuse.py --trees ps4=.,ps16=.@prefix_splits=16,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s19_lora_smi() { limit 300 python3 bench/lora.py steps --cases 7b_lora_unmerged_gc --steps 3 --out $RES; }

# session 19's second machine: the warm start again, the real multi-turn workload with the old tree first (so the
# new tree's runs are not the ones that fill torch.compile's cache), the new tree twice; OLMoE's eager baseline
#   s19_warm s19_mt2 s19_moe_eager
phase_s19_mt2() {  # JSON lines in the phase's log
    local real="--backend fast --model /tmp/agent_run/warm_sft/hf_model --data /tmp/agent_run/data/train.jsonl \
        --prompts 64 --n 8 --max-response-tokens 384"
    limit 120 python3 .baseline_tree/bench/multiturn.py $real --max-batch 512
    limit 120 python3 bench/multiturn.py $real
    limit 120 python3 bench/multiturn.py $real
}
phase_s19_moe_eager() { limit 240 python3 bench/moe.py update --shape olmoe --experts eager --out $RES; }

# session 20, first machine (one H200): what session 19 did not reach of issues 35 and 32 (R3 router replay against
# none; OLMoE's eager baseline in the run of the compiled engine; Qwen3-30B-A3B with LoRA, compiled and HF's eager
# experts; the 7B LoRA step's device peak as nvidia-smi counts it)
#   s20_replay s20_olmoe s19_lora_smi s20_qwen3
phase_s20_replay() { limit 240 python3 bench/moe.py replay --shape qwen3_moe_7b --steps 3 --modes R3,disabled --out $RES \
    --extra "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192"; }
phase_s20_olmoe() { limit 300 python3 bench/moe.py update --shape olmoe --experts grouped_mm+compile,eager --out $RES; }
phase_s20_qwen3() {
    limit 300 python3 bench/moe.py update --shape qwen3_30b_a3b --experts grouped_mm+compile --out $RES
    limit 240 python3 bench/moe.py update --shape qwen3_30b_a3b --experts eager --steps 1 --out $RES
}

# session 20, second machine (one H200): the prefill kernel over cached prefixes in the CUDA tests; the real
# multi-turn workload (old tree first, at 512 slots; the new tree twice, the second profiled); long prompts with 16
# prefix splits against the old tree
#   s20_tests s19_warm s20_mt s20_prefix
phase_s20_tests() { limit 150 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
    tests/test_rollout_fast.py; }
phase_s20_mt() {  # JSON lines in the phase's log
    local real="--backend fast --model /tmp/agent_run/warm_sft/hf_model --data /tmp/agent_run/data/train.jsonl \
        --prompts 64 --n 8 --max-response-tokens 384"
    limit 100 python3 .baseline_tree/bench/multiturn.py $real --max-batch 512
    limit 100 python3 bench/multiturn.py $real
    limit 130 python3 bench/multiturn.py $real --profile
}
phase_s20_prefix() { limit 280 python3 bench/prefix_reuse.py --trees ps16=.@prefix_splits=16,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }

phase_s20_qwen3_eager() { limit 220 python3 bench/moe.py update --shape qwen3_30b_a3b --experts eager --steps 1 --out $RES; }

# next session (one H200): OLMoE in the fast rollout (CUDA graphs against HF; decode against HF generate and the
# floor; R3 on OLMoE itself)
#   s21_tests s21_olmoe
phase_s21_tests() { limit 420 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs \
    tests/test_prefix_cache.py tests/test_rollout_fast.py tests/test_rollout_fast_families.py; }
phase_s21_olmoe() {
    limit 300 python3 bench/moe.py rollout --shape olmoe --out $RES
    limit 300 python3 bench/moe.py replay --shape olmoe --steps 3 --modes R3,disabled --out $RES \
        --extra "model.dtype=bfloat16 actor.engine.max_token_len_per_gpu=8192"
}

# session 21 (one H200): the shared-prefix decode's kernels alone, swept (where its 4.2 ms a step goes); the CUDA
# tests of the prefill and decode kernels after they came to share their steps, and OLMoE's; the 7B LoRA step with
# the base gathered a layer at a time against it kept whole (nvidia-smi's peak)
#   s21_cascade s21_tests s21_lora s21_olmoe; then, with the shared-prefix kernel beside the per-slot one and its
#   programs walking the live groups: s21_cascade s21_tests s21_prefix
phase_s21_cascade() { limit 400 python3 bench/profile_cascade.py --out $RES; }
phase_s21_prefix() { limit 300 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s21_profile() { limit 240 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree --profile --repeats 1 \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s21_lora() { limit 480 python3 bench/lora.py steps --cases 7b_lora_least,7b_lora_unmerged_gc --steps 3 --out $RES; }

# next session (one H200), issue 36's long prompts (1.43x, target 1.5x): the shared-prefix kernel is 233 of the call's
# 1,309 ms of kernels at about 2x its floor, one wave of two programs per SM, each latency-bound over 4 tiles (see
# bench/RESULTS.md, session 21); a variant that keeps more bytes in flight per SM (fewer registers per row, or TMA
# loads of whole blocks) would be timed by `s21_cascade`, then `s21_prefix` against the old tree; `s21_tests` after.

# session 22 (one H200): the shared-prefix and per-slot kernels reading a cache block a step (the next block's id a
# step ahead, three blocks in flight), the per-slot kernel at 2 warps under a cascade and its new entry's loads
# first; the long prompts against session 21's tree (.s21_tree: `git archive 983ddd9 shardrl bench`) and the old one
#   s22_cascade s22_prefix s21_tests; then, two prefix splits the default (one program per SM, beside the per-slot
#   kernel's): s22_prefix2; s21_tests s22_prefix3
# next session (one H200), issue 36's long prompts at 1.48-1.51x (target 1.5x, no margin): the runs differ in the
# admission (0.353-0.375 s of 1.34-1.41), where the decode is steady (0.914-0.920 s): `s21_profile` on the new tree
# puts numbers on the admission's prefill (GEMMs, SDPA, norms, the chunks of 16,384 tokens) and on the decode's
# non-attention kernels; the plain paged decode (no groups) now reads a block a step too: `profile_decode` and
# `rollout256` would re-measure the fast rollout's figures of bench/RESULTS.md under it.
phase_s22_cascade() { limit 300 python3 bench/profile_cascade.py --out $RES; }
phase_s22_prefix2() { limit 400 python3 bench/prefix_reuse.py --trees new=.,ps4=.@prefix_splits=4,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s22_prefix3() { limit 300 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s22_prefix() { limit 400 python3 bench/prefix_reuse.py --trees new=.,s21=.s21_tree,old=.baseline_tree \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }

# session 23 (one H200): where the long-prompt call's time goes (kernels by kind, the device's idle time, the admission
# alone at several chunk sizes, sync_every), the decode GEMMs at 256 rows under cuBLAS, cuBLASLt and max-autotune, the
# prefill's attention backends; the whole rollout with max-autotune GEMMs and with cuBLASLt
#   s23_gemm s23_rollout s23_autotune s23_lt
phase_s23_gemm() { limit 300 python3 bench/exp_long_prompt.py --parts gemm --out $RES; }
phase_s23_rollout() { limit 300 python3 bench/exp_long_prompt.py --parts rollout --out $RES; }
phase_s23_autotune() { TORCHINDUCTOR_MAX_AUTOTUNE_GEMM=1 limit 420 python3 bench/exp_long_prompt.py --parts rollout \
    --tag autotune --no-sweep --no-profile --out $RES; }
phase_s23_lt() { limit 240 python3 bench/exp_long_prompt.py --parts rollout --tag cublaslt --blas cublaslt --no-sweep \
    --no-profile --out $RES; }
# then, the admission's copies from pinned memory (no wait for the device), the end of a call's host work cut:
#   s23_prefix s23_profile s23_tests
phase_s23_prefix() { limit 420 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree --repeats 3 \
    --shape 1.5b --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }
phase_s23_profile() { limit 240 python3 bench/exp_long_prompt.py --parts rollout --tag pinned --no-sweep --out $RES; }
phase_s23_tests() { limit 480 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs \
    tests/test_prefix_cache.py tests/test_rollout_fast.py tests/test_rollout_fast_families.py; }
# then the long prompts twice more against the old tree, and the server under 256 clients against direct calls
#   s23_final s23_serve   (carry .baseline_tree and .whl/oai)
phase_s23_final() { phase_s23_prefix; phase_s23_prefix; }
phase_s23_serve() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 300 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --out $RES
}
# then the server again, with its responses serialized by json (not FastAPI's encoder) and at most 32 disconnect
# checks a tick; and with 512 clients of one request each (no client waits for its first answer)
#   s23_serve2   (carry .whl/oai)
phase_s23_serve2() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 240 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --out $RES
    limit 240 python3 bench/serve.py --shape 1.5b --clients 512 --requests 1 --out $RES
}
# then the server at a 0.05 ms switch interval (does the generation thread wait for the interpreter lock?)
#   s23_serve3   (carry .whl/oai)
phase_s23_serve3() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --switch-interval-ms 0.05 --out $RES
}

# session 24: where the server's time goes: the clients over 1 and 8 processes, and the batcher without HTTP
#   s24_diag   (carry .whl/oai)
phase_s24_diag() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --in-process --out $RES
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --out $RES
}

# then every admission of the batcher's stream (without HTTP) and of direct calls timed, one of each profiled
#   s24_admit
phase_s24_admit() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 300 python3 bench/exp_admit.py --out $RES
}

# then the same with the U = 1 recompile gone and the prefill's small chunks on flash (no cuDNN plan a new shape)
#   s24_admit2   (carry .whl/oai)
phase_s24_admit2() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 300 python3 bench/exp_admit.py --profile-at -1 --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --in-process --flash-below 16384 --out $RES
}

# then the server with its HTTP front end in a process of its own (now the default), and in a thread; the CUDA tests
#   s24_serve   (carry .whl/oai)
phase_s24_serve() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --in-process --out $RES
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --front-end thread --out $RES
    limit 300 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore tests/test_prefix_cache.py \
        tests/test_rollout_fast.py tests/test_rollout_fast_families.py
}
# then the long-prompt GRPO call against the old tree (carry .baseline_tree)
phase_s24_prefix() { limit 400 python3 bench/prefix_reuse.py --trees new=.,old=.baseline_tree --repeats 2 --shape 1.5b \
    --prompts 32 --n 8 --prompt-len 2048 --new-tokens 256 --out $RES; }

# then where the served decode steps wait: the host's launch time and every thread's frames sampled
#   s24_stacks   (carry .whl/oai)
phase_s24_stacks() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --sample-stacks --out $RES
}

# then the server after two warm-up runs (its steady state: the decode graphs captured), front end in a process and
# in a thread
#   s24_steady   (carry .whl/oai)
phase_s24_steady() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --warm-ups 2 --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --warm-ups 2 --front-end thread --out $RES
}

# not run yet (session 24's device time ran out): the server's stream admitting after it launches the decode steps
# (overlap) against admitting first, steady state, front end in a process; and the batcher alone
#   s24_overlap   (carry .whl/oai)
phase_s24_overlap() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --warm-ups 2 --overlap --in-process \
        --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --warm-ups 2 --out $RES
}

# session 25 (issue 36's server): the clients spread over processes (one `openai` process spends ~1.8 ms of a core
# a request: bench/front_end.py), two front ends, the overlapped admission; the GPU tests after
#   s25_a   (carry .whl/oai, rebuilt by bench/pack_server_wheels.sh: httptools and uvloop too)
phase_s25_a() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --in-process --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --front-ends 2 \
        --overlap --in-process --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --front-ends 2 --out $RES
    limit 400 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
        tests/test_rollout_fast.py tests/test_rollout_fast_families.py
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --out $RES
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --client raw --out $RES
    limit 120 python3 bench/front_end.py --front-ends 1,2,4 --load-procs 4 --out $RES
}
# the least of s25_a (a session short of device time): the clients over 8 processes, with the batcher alone and the
# direct calls in the same run; then the same with two front ends and the overlapped admission; the fast rollout's tests
#   s25_b   (carry .whl/oai)
phase_s25_b() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --in-process --out $RES
    limit 160 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --front-ends 2 \
        --overlap --in-process --out $RES
    limit 200 python3 -m pytest -q -p no:cacheprovider -m cuda -W ignore -rs tests/test_prefix_cache.py \
        tests/test_rollout_fast.py
}
# session 28 (issue 36's server): TCP_NODELAY on the engine connection, every request's legs timed (`arrivals.hops`);
# the GPU's stand-in on the device host (does the host alone spread the first wave?); overlap again; the front-end
# bench on 16 cores; every CUDA test
#   s28   (carry .whl/oai, from bench/pack_server_wheels.sh)
phase_s28() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 200 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --in-process --out $RES
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --client raw --out $RES
    limit 120 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --client raw \
        --backend sim --in-process --out $RES
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --overlap --out $RES
    limit 100 python3 bench/front_end.py --front-ends 1,2,4 --load-procs 4 --out $RES
    limit 420 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore -rs tests/
}
# session 29 (issue 36's server): s28's server runs, plus clients warmed before the common start (`--warm-clients`:
# their connections open, as an agent loop's long-lived client), overlap and two front ends each alone, the
# threads' stacks sampled; the CUDA tests in the next call (tests_all)
#   s29   (carry .whl/oai, from bench/pack_server_wheels.sh)
phase_s29() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    local S="python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --out $RES"
    limit 200 $S --in-process
    limit 120 $S --warm-clients
    limit 120 $S --warm-clients --client raw
    limit 120 $S --warm-clients --overlap
    limit 120 $S --warm-clients --front-ends 2
    limit 120 $S --warm-clients --sample-stacks
    limit 100 $S --client raw --backend sim --in-process
}
phase_s29_b() {  # the overlapped admission again, with cold clients (as s28 had them) and warm ones
    local S="python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --out $RES"
    limit 120 $S --overlap
    limit 120 $S --warm-clients --overlap
    limit 330 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore -rs tests/
}
phase_s29_c() {  # the fast rollout's CUDA tests (abort, overlap path); the overlapped admission as the server's default
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    limit 170 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore -rs tests/test_rollout_fast.py \
        tests/test_rollout_fast_families.py
    limit 150 python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --in-process --out $RES
}
# owed by session 29: the server with the engine connection's lists (frontend.Outbox) and overlap as defaults, three
# runs; the fast rollout's CUDA tests, whole; then every CUDA test
#   s30   (carry .whl/oai, from bench/pack_server_wheels.sh)
phase_s30() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
    local S="python3 bench/serve.py --shape 1.5b --clients 256 --requests 2 --client-procs 8 --out $RES"
    limit 150 $S --in-process
    limit 110 $S
    limit 110 $S --warm-clients
    limit 400 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore -rs tests/test_rollout_fast.py \
        tests/test_rollout_fast_families.py tests/test_prefix_cache.py
    limit 560 python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore -rs tests/ --deselect tests/test_rollout_fast.py \
        --deselect tests/test_rollout_fast_families.py --deselect tests/test_prefix_cache.py
}
case "${1:-}" in
start)
    shift
    # `next`: what is left to measure, in the order to run it (one device call): the fast rollout's GPU
    #   tests (the fused sampler included), the decode profile (parts in graphs, the floor), batch 256
    if [ "${1:-}" = next ]; then
        set -- tests_rollout profile_decode rollout256
        export ROLLOUT256_ROWS=${ROLLOUT256_ROWS:-hf_dynamic,fast,fast_torch_sampler}
    fi
    mkdir -p "$GS"
    rm -f "$GS/DONE"  # before `wait` can look: a warm machine keeps the last session's
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader > "$GS/session.log"
    setsid nohup bash "$0" run "$@" >> "$GS/session.log" 2>&1 < /dev/null &
    ;;
run)
    shift
    rm -f "$GS/DONE"
    for ph in "$@"; do
        echo "== $ph start $(date +%T)"
        "phase_$ph" > "$GS/$ph.log" 2>&1
        echo "== $ph rc=$? end $(date +%T)"
    done
    touch "$GS/DONE"
    ;;
wait)
    end=$((SECONDS + ${2:-540}))
    while [ ! -f "$GS/DONE" ] && [ $SECONDS -lt $end ]; do sleep 5; done
    [ -f "$GS/DONE" ] && echo "ALL DONE" || echo "STILL RUNNING"
    collect
    ;;
*)
    echo "usage: $0 start PHASE... | wait SECONDS" >&2; exit 2 ;;
esac
