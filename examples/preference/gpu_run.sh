#!/usr/bin/env bash
# DPO and a reward model on SmolLM2-135M-Instruct's own samples of the word problems, one GPU: greedy held-out
# accuracy before; pairs from 8 samples of each training and held-out prompt (`pairs.py`); `shardrl dpo` at two
# learning rates, each measured after; `shardrl rm`, its accuracy on the held-out pairs; GRPO scored by that
# reward model only (examples/smollm2/gpu.yaml), measured after with the true "####" scorer; a summary.
#
#   bash examples/smollm2/gpu_run.sh pack            # HERE: the GGUF in two parts + the gguf wheel, under .whl/
#   bash examples/preference/gpu_run.sh start        # THERE: joins the GGUF (examples/gpu_run_common.sh), runs detached
#   bash examples/preference/gpu_run.sh wait SECONDS # THERE: waits for the run (or SECONDS), copies results to $OUT
set -u
GR=${GR:-/tmp/preference_run}
GGUF=${GGUF:-/tmp/smollm2.gguf}
RL_STEPS=${RL_STEPS:-30}
DPO_LRS=${DPO_LRS:-"2e-6 1e-5"}
SAMPLES=${SAMPLES:-8}          # samples per prompt for the pairs
TEMPERATURE=${TEMPERATURE:-1.0}
BASE_EVAL=${BASE_EVAL:-1}
MISSING_EOS_PENALTY=${MISSING_EOS_PENALTY:-5}  # the RL run's: a cut response scores this much less (null: none)
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/../gpu_run_common.sh"

evaluate() {  # evaluate NAME MODEL: greedy accuracy on the 200 held-out problems
    step "eval_$1" python3 examples/smollm2/evaluate.py "$2" "$GR/assets/val.jsonl" --max-new-tokens 128
}

run() {
    mkdir -p "$GR"
    echo "start $(date +%s)" > "$GR/status"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"  # the gguf package, installed by gguf_join
    local A="$GR/assets" P="$GR/pairs"
    step prepare python3 examples/smollm2/prepare.py --gguf "$GGUF" --out "$A"
    [ "$BASE_EVAL" = 1 ] && evaluate base "$A/model"
    local sampling=(--n "$SAMPLES" --temperature "$TEMPERATURE")
    step pairs_train python3 examples/preference/pairs.py "$A/model" "$A/train.jsonl" "$P/train.jsonl" "${sampling[@]}"
    step pairs_val python3 examples/preference/pairs.py "$A/model" "$A/val.jsonl" "$P/val.jsonl" --seed 1 \
        "${sampling[@]}"
    local common=("model.path=$A/model" "data.train_files=[$P/train.jsonl]" "data.val_files=[$P/val.jsonl]")
    for lr in $DPO_LRS; do
        step "dpo_$lr" python3 -m shardrl.trainer.dpo examples/preference/dpo.yaml "${common[@]}" "optim.lr=$lr" \
            "trainer.output_dir=$GR/dpo_$lr"
        evaluate "dpo_$lr" "$GR/dpo_$lr/hf_model"
    done
    step rm python3 -m shardrl.trainer.rm examples/preference/rm.yaml "${common[@]}" "trainer.output_dir=$GR/rm"
    step rl_rm python3 -m shardrl.trainer.main examples/smollm2/gpu.yaml "model.path=$A/model" \
        "data.train_files=[$A/train.jsonl]" "data.val_files=[]" "trainer.val_freq=0" \
        "reward.model_path=$GR/rm/hf_model" "reward.engine.use_dynamic_bsz=true" \
        "reward.engine.max_token_len_per_gpu=32768" "reward.missing_eos_penalty=$MISSING_EOS_PENALTY" "trainer.total_steps=$RL_STEPS" "trainer.output_dir=$GR/rl_rm" \
        "trainer.export_hf=true" "trainer.logger=[console,jsonl]"
    evaluate rl_rm "$GR/rl_rm/hf_model"
    python3 - "$GR" <<'PY' > "$GR/summary.json"
import glob, json, os, sys
gr = sys.argv[1]
def last_json(path):
    try:
        rows = [json.loads(l) for l in open(path) if l.startswith("{")]
    except FileNotFoundError:
        return None
    return rows[-1] if rows else None
def records(folder):
    try:
        return [json.loads(l) for l in open(f"{folder}/metrics.jsonl")]
    except FileNotFoundError:
        return []
summary = {"seconds": dict(l.split()[:2] for l in open(f"{gr}/seconds")),
           "pairs": {k: last_json(f"{gr}/pairs_{k}.log") for k in ("train", "val")},
           "accuracy": {os.path.basename(p)[5:-4]: (last_json(p) or {}).get("accuracy")
                        for p in sorted(glob.glob(f"{gr}/eval_*.log"))}}
for folder in sorted(glob.glob(f"{gr}/dpo_*/")) + [f"{gr}/rm/"]:
    folder = folder.rstrip("/")
    recs = records(folder)
    keys = [k for k in (recs[-1] if recs else {}) if k.startswith("val/")]
    summary[os.path.basename(folder)] = {"val_curve": [[r["step"]] + [round(r[k], 4) for k in keys]
                                                       for r in recs if keys[0] in r] if keys else [],
                                         "val_keys": keys, "step_s": recs[-1].get("timing/step_s") if recs else None}
rl = records(f"{gr}/rl_rm")
summary["rl_rm_reward_curve"] = [[r["step"], round(r["reward/mean"], 3)] for r in rl]
print(json.dumps(summary, indent=1))
PY
    echo "done $(date +%s)" >> "$GR/status"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    mkdir -p "$OUT/preference"
    cp "$GR/summary.json" "$GR/status" "$GR/seconds" "$OUT/preference/" 2>/dev/null
    for d in "$GR"/dpo_*/ "$GR/rm/" "$GR/rl_rm/"; do
        [ -f "$d/metrics.jsonl" ] && cp "$d/metrics.jsonl" "$OUT/preference/$(basename "$d").metrics.jsonl"
    done
    head -c 100000 "$GR/pairs/val.jsonl" > "$OUT/preference/val_pairs_head.jsonl" 2>/dev/null
    # the logs' last lines in one file (the device returns a limited number of files)
    for f in "$GR"/*.log; do echo "== $(basename "$f")"; tail -c 3000 "$f"; done > "$OUT/preference/logs.txt"
}

case "${1:-}" in
    start) start_detached "$0" || exit 1 ;;
    _run) run ;;
    wait)
        wait_run "${2:-540}"
        cat "$GR/status" "$GR/seconds" 2>/dev/null
        collect
        [ -f "$GR/summary.json" ] && head -c 6000 "$GR/summary.json" ;;
    *) echo "usage: $0 start|wait [SECONDS]"; exit 2 ;;
esac
