#!/usr/bin/env bash
# The GPU session of issue 32 (LoRA) and issue 33 (preference), in three consecutive calls of the device tool
# (files under /tmp stay while the machine is warm). The GGUF travels in two parts (`examples/smollm2/gpu_run.sh
# pack`, then part00 under .whl_a/, the rest under .whl_b/).
#   call 1: carry .whl_a -> bash bench/lora_session.sh one
#   call 2: carry .whl_b -> bash bench/lora_session.sh two
#   call 3:              -> bash bench/lora_session.sh three
# (What ran on 2026-12-01, session 12, differed: the 32B step beside the other runs, two of which died of CUDA
# OOM; the preference run was repeated alone: `BASE_EVAL=0 bash examples/preference/gpu_run.sh start`, `wait`.)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
LORA_RUN="model.lora.rank=32 model.lora.alpha=32 model.lora.target_modules=all-linear"
collect() {
    mkdir -p /tmp/collect
    for gr in /tmp/lora_a /tmp/lora_b; do
        [ -f "$gr/summary.json" ] && cp "$gr/summary.json" "/tmp/collect/$(basename $gr)_summary.json"
        [ -f "$gr/train/metrics.jsonl" ] && cp "$gr/train/metrics.jsonl" "/tmp/collect/$(basename $gr)_metrics.jsonl"
        [ -f "$gr/train.log" ] && tail -c 20000 "$gr/train.log" > "/tmp/collect/$(basename $gr)_train_tail.log"
        cp "$gr/status" "/tmp/collect/$(basename $gr)_status" 2>/dev/null
    done
    GR=/tmp/preference_run OUT=/tmp/collect bash examples/preference/gpu_run.sh wait 1 > /dev/null 2>&1
    tar czf "$OUT/runs.tgz" -C /tmp collect
}
case "${1:-}" in
    # session 13: every one-GPU CUDA test and the update profiled (call 1), then the 7B steps against full
    # fine-tuning with fp32 master weights and the offload it needs (call 2)
    tests_update)
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
        timeout 370 python3 -m pytest -m cuda tests -q -rs -p no:cacheprovider --durations=10 2>&1 | tail -30
        timeout 210 python3 bench/lora.py update --shape 7b --out "$OUT/lora.jsonl" 2>&1 | grep -v Warning | tail -4
        ;;
    steps7b)
        timeout 570 python3 bench/lora.py steps --cases "${CASES:-7b_lora,7b_full_bf16,7b_full}" --steps "${STEPS:-5}" \
            --case-timeout-s "${CASE_S:-180}" --out "$OUT/lora.jsonl" 2>&1 | tail -4
        ;;
    one)
        mkdir -p /tmp/smollm2_parts && cp .whl_a/* /tmp/smollm2_parts/
        nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
        timeout 100 python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k gpu 2>&1 | tail -4
        timeout 200 python3 bench/lora.py sync --shape 7b --out "$OUT/lora.jsonl" 2>&1 | grep -v Warning | tail -6
        timeout 260 python3 bench/lora.py steps --cases 7b_lora,7b_full_bf16 --out "$OUT/lora.jsonl" 2>&1 | tail -3
        ;;
    two)  # the 32B step alone first: beside it (92 GiB) the SmolLM2 runs' updates ran out of memory
        mkdir -p /tmp/smollm2_parts && cp .whl_b/* /tmp/smollm2_parts/
        timeout 330 python3 bench/lora.py steps --cases 32b_lora --out "$OUT/lora.jsonl" 2>&1 | tail -3
        bash examples/preference/gpu_run.sh start
        GR=/tmp/lora_a EXTRA="$LORA_RUN actor.optim.lr=2e-5" bash examples/smollm2/gpu_run.sh start
        GR=/tmp/lora_b EXTRA="$LORA_RUN actor.optim.lr=5e-5" bash examples/smollm2/gpu_run.sh start
        sleep "${WAIT_S:-200}"
        cat /tmp/preference_run/status /tmp/lora_a/status /tmp/lora_b/status 2>/dev/null
        collect
        ;;
    three)
        for gr in /tmp/preference_run /tmp/lora_a /tmp/lora_b; do
            GR=$gr bash examples/smollm2/gpu_run.sh wait "${WAIT_S:-400}" > /dev/null 2>&1
        done
        cat /tmp/preference_run/status /tmp/lora_a/status /tmp/lora_b/status 2>/dev/null
        [ -n "${CASES:-}" ] && timeout "${CASE_S:-300}" python3 bench/lora.py steps --cases "$CASES" --steps 2 \
            --out "$OUT/lora.jsonl" 2>&1 | tail -3
        collect
        ;;
esac
