#!/usr/bin/env bash
# The tools example on one GPU: SmolLM2-135M-Instruct from the GGUF, the tool-use warm start (`shardrl sft
# examples/tools/warm_start.yaml`, measured before and after on the held-out word problems), GRPO with the calculator (examples/tools/gpu.yaml, validated every
# 5 steps: reward, tool-call rate, clean-call rate), the trained model measured again, and a summary.
#
#   bash examples/smollm2/gpu_run.sh pack            # HERE: the GGUF in two parts + the gguf wheel, under .whl/
#   bash examples/tools/gpu_run.sh start             # THERE: joins the GGUF (examples/gpu_run_common.sh), runs detached
#   bash examples/tools/gpu_run.sh wait SECONDS      # THERE: waits for the run (or SECONDS), copies results to $OUT
#
# How the GGUF reaches the device machine: see examples/smollm2/gpu_run.sh (two calls, 64 MiB each).
# Evaluations use gpu.yaml's multi-turn limits: 4 model turns of at most 128 tokens, 384 response tokens.
set -u
GR=${GR:-/tmp/tools_run}
GGUF=${GGUF:-/tmp/smollm2.gguf}
STEPS=${STEPS:-30}
NUM_VAL=${NUM_VAL:-200}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-600}
TRAIN_CONFIG=${TRAIN_CONFIG:-examples/tools/gpu.yaml}  # examples/agent/gpu.yaml: the same task as an agent episode
VAL_FREQ=${VAL_FREQ:-5}
BASE_EVAL=${BASE_EVAL:-1}  # 0: skip measuring SmolLM2-135M-Instruct itself before the warm start
# WARM_ONLY=1: stop after the warm start (the model bench/multiturn.py's real workload runs on)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/../gpu_run_common.sh"
EVAL=(--val "$GR/data/val.jsonl" --num-val "$NUM_VAL" --max-turns 4 --max-response-tokens 384 --max-new-tokens 128)

run() {
    mkdir -p "$GR"
    echo "start $(date +%s)" > "$GR/status"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"  # the gguf package, installed by gguf_join
    step prepare python3 examples/smollm2/prepare.py --gguf "$GGUF" --out "$GR/smollm2"
    step data python3 examples/tools/prepare.py --out "$GR/data"
    [ "$BASE_EVAL" = 0 ] || step base python3 examples/tools/warm_start.py eval --model "$GR/smollm2/model" "${EVAL[@]}"
    step warm_data python3 examples/tools/warm_start.py data --out "$GR/data/warm_start.jsonl"
    step warm_start python3 -m shardrl.trainer.sft examples/tools/warm_start.yaml "model.path=$GR/smollm2/model" \
        "data.train_files=[$GR/data/warm_start.jsonl]" "trainer.output_dir=$GR/warm_sft" "engine.param_dtype=bfloat16"
    if [ "${WARM_ONLY:-0}" = 1 ]; then echo "done $(date +%s)" >> "$GR/status"; return; fi  # the warm start alone
    step warm_eval python3 examples/tools/warm_start.py eval --model "$GR/warm_sft/hf_model" "${EVAL[@]}"
    local t0=$(date +%s)
    setsid timeout -k 20 "$TRAIN_LIMIT_S" python3 -m shardrl.trainer.main "$TRAIN_CONFIG" \
        "model.path=$GR/warm_sft/hf_model" "data.train_files=[$GR/data/train.jsonl]" "data.val_files=[$GR/data/val.jsonl]" \
        "trainer.total_steps=$STEPS" "trainer.val_freq=$VAL_FREQ" "trainer.output_dir=$GR/train" "trainer.export_hf=true" \
        "trainer.logger=[console,jsonl]" > "$GR/train.log" 2>&1
    echo "train_exit $? $(( $(date +%s) - t0 ))" >> "$GR/seconds"
    if [ -d "$GR/train/hf_model" ]; then
        step after python3 examples/tools/warm_start.py eval --model "$GR/train/hf_model" "${EVAL[@]}"
    fi
    python3 - "$GR" <<'EOF' > "$GR/summary.json"
import json, statistics, sys
gr = sys.argv[1]
def last_report(path):
    try:
        rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    except FileNotFoundError:
        return None
    return rows[-1] if rows else None
try:
    records = [json.loads(line) for line in open(f"{gr}/train/metrics.jsonl")]
except FileNotFoundError:
    records = []
val_keys = ("val/reward_mean", "val/multi_turn/tool_call_rate", "val/multi_turn/clean_call_rate")
steps = [r["timing/step_s"] for r in records if "timing/step_s" in r]
print(json.dumps({
    "seconds": dict(line.split()[:2] for line in open(f"{gr}/seconds")),
    "steps_done": records[-1]["step"] if records else 0,
    "base_model": last_report(f"{gr}/base.log"),
    "warm_start": last_report(f"{gr}/warm_eval.log"),
    "after_rl": last_report(f"{gr}/after.log"),
    "val_curve": [[r["step"]] + [round(r.get(k, float("nan")), 4) for k in val_keys] for r in records
                  if "val/reward_mean" in r],
    "train_reward_curve": [[r["step"], round(r["reward/mean"], 4)] for r in records],
    "tool_calls_curve": [[r["step"], round(r.get("multi_turn/num_tool_calls_mean", 0), 3),
                          round(r.get("multi_turn/num_tool_errors_mean", 0), 3)] for r in records],
    "response_length_curve": [[r["step"], round(r.get("response/length_mean", 0), 1)] for r in records],
    "step_s_median": statistics.median(steps) if steps else None,
    "gen_s_median": statistics.median(r["timing/gen_s"] for r in records) if records else None,
    "logprob_abs_diff_max": max((r.get("rollout/logprob_abs_diff", 0) for r in records), default=None),
}, indent=1))
EOF
    echo "done $(date +%s)" >> "$GR/status"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT/tools"
    cp "$GR/summary.json" "$GR/status" "$GR/seconds" "$OUT/tools/" 2>/dev/null
    cp "$GR/train/metrics.jsonl" "$GR/train/generations.jsonl" "$OUT/tools/" 2>/dev/null
    for f in "$GR"/*.log; do tail -c 30000 "$f" > "$OUT/tools/$(basename "$f")"; done
}

case "${1:-}" in
    start) start_detached "$0" || exit 1 ;;
    _run) run ;;
    wait)
        wait_run "${2:-540}"
        cat "$GR/status" "$GR/seconds" 2>/dev/null; tail -n 3 "$GR/train.log" 2>/dev/null | tr '\r' '\n' | tail -n 2
        collect
        [ -f "$GR/summary.json" ] && head -c 4000 "$GR/summary.json" ;;
    *) echo "usage: $0 start|wait [SECONDS]"; exit 2 ;;
esac
