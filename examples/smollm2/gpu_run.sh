#!/usr/bin/env bash
# SmolLM2-135M-Instruct learns arithmetic word problems on one GPU: greedy validation accuracy before
# training, GRPO for STEPS steps (examples/smollm2/gpu.yaml, validated every 5 steps), the curve and a summary.
#
#   bash examples/smollm2/gpu_run.sh pack              # HERE: the GGUF in two parts + the gguf wheel, under .whl/
#   bash examples/smollm2/gpu_run.sh start             # THERE: `join`, then runs detached
#   bash examples/smollm2/gpu_run.sh join              # THERE: /tmp/smollm2.gguf from its parts; gguf under /tmp/site
#   bash examples/smollm2/gpu_run.sh wait SECONDS      # THERE: waits for the run (or SECONDS), copies results to $OUT
#
# The device machine has no `gguf` package and a call carries at most 64 MiB, so the 98 MB GGUF travels in
# two parts over two calls (files under /tmp stay while the machine is warm); the conversion runs there.
# A call may run 10 minutes, the whole run takes longer: `start` detaches it (setsid) and `wait` collects.
set -u
GR=${GR:-/tmp/smollm2_run}
GGUF=${GGUF:-/tmp/smollm2.gguf}
STEPS=${STEPS:-60}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-780}   # the training's own wall-clock limit (~13 min)
EXTRA=${EXTRA:-}                      # more overrides, e.g. EXTRA="model.lora.rank=32 actor.optim.lr=2e-5"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
. "$(dirname "$0")/../gpu_run_common.sh"

pack() {  # on the development machine, in the repository root (.whl/ is git-ignored)
    local src
    src=$(python3 -c 'import sys; sys.path.insert(0, "examples/smollm2"); import prepare; print(prepare.find_gguf())') || exit 1
    mkdir -p .whl
    split -b 50M -d "$src" .whl/smollm2.gguf.part
    sha256sum "$src" | cut -d' ' -f1 > .whl/smollm2.gguf.sha256
    python3 -m pip download -q --no-deps --only-binary=:all: -d .whl gguf==0.19.0
    ls -la .whl
}

run() {  # the whole run, detached by `start`
    mkdir -p "$GR"
    echo "start $(date +%s)" > "$GR/status"
    export PYTHONPATH="$PYTHONPATH:/tmp/site"  # the gguf package, installed by `join` (gguf_join)
    local t0=$(date +%s)
    python3 examples/smollm2/prepare.py --gguf "$GGUF" --out "$GR/assets" > "$GR/prepare.log" 2>&1 \
        || { echo "failed: prepare" >> "$GR/status"; return 1; }
    local t1=$(date +%s)
    python3 examples/smollm2/evaluate.py "$GR/assets/model" "$GR/assets/val.jsonl" --max-new-tokens 128 \
        > "$GR/before.json" 2> "$GR/evaluate.log" || { echo "failed: evaluate" >> "$GR/status"; return 1; }
    local t2=$(date +%s)
    setsid timeout -k 20 "$TRAIN_LIMIT_S" python3 -m shardrl.trainer.main examples/smollm2/gpu.yaml \
        "model.path=$GR/assets/model" "data.train_files=[$GR/assets/train.jsonl]" \
        "data.val_files=[$GR/assets/val.jsonl]" "trainer.total_steps=$STEPS" "trainer.output_dir=$GR/train" \
        "trainer.logger=[console,jsonl]" $EXTRA > "$GR/train.log" 2>&1
    local rc=$? t3=$(date +%s)
    python3 - "$GR" "$rc" "$t0" "$t1" "$t2" "$t3" <<'EOF' > "$GR/summary.json"
import json, statistics, sys
gr, rc, t0, t1, t2, t3 = sys.argv[1], int(sys.argv[2]), *map(int, sys.argv[3:])
before = json.load(open(f"{gr}/before.json"))
try:
    records = [json.loads(line) for line in open(f"{gr}/train/metrics.jsonl")]
except FileNotFoundError:
    records = []
val = [(r["step"], r["val/reward_mean"]) for r in records if "val/reward_mean" in r]
steps = [r["timing/step_s"] for r in records if "timing/step_s" in r]
print(json.dumps({
    "train_exit_code": rc, "steps_done": records[-1]["step"] if records else 0,
    "val_accuracy_before": before["accuracy"], "val_accuracy_curve": [[0, before["accuracy"]]] + val,
    "val_accuracy_after": val[-1][1] if val else None,
    "train_reward_curve": [[r["step"], round(r["reward/mean"], 4)] for r in records],
    "response_length_curve": [[r["step"], round(r.get("response/length_mean", 0), 1)] for r in records],
    "step_s_median": statistics.median(steps) if steps else None,
    "logprob_abs_diff_max": max((r.get("rollout/logprob_abs_diff", 0) for r in records), default=None),
    "seconds": {"prepare": t1 - t0, "evaluate_before": t2 - t1, "train": t3 - t2},
    "before": before,
}, indent=1))
EOF
    echo "done $(date +%s) rc=$rc" >> "$GR/status"
}

collect() {
    [ -n "${OUT:-}" ] || return 0
    cp "$GR/summary.json" "$GR/before.json" "$GR/status" "$OUT/" 2>/dev/null
    cp "$GR/train/metrics.jsonl" "$OUT/" 2>/dev/null
    tail -c 200000 "$GR/train.log" > "$OUT/train.log" 2>/dev/null
    tail -c 20000 "$GR/prepare.log" > "$OUT/prepare.log" 2>/dev/null
    tail -c 20000 "$GR/evaluate.log" > "$OUT/evaluate.log" 2>/dev/null
}

case "${1:-}" in
    pack) pack ;;
    join) gguf_join ;;
    start) start_detached "$0" || exit 1 ;;
    _run) run ;;
    wait)
        wait_run "${2:-540}"
        cat "$GR/status"; tail -n 3 "$GR/train.log" 2>/dev/null | tr '\r' '\n' | tail -n 2
        collect
        [ -f "$GR/summary.json" ] && cat "$GR/summary.json" | head -c 3000 ;;
    *) echo "usage: $0 pack|join|start|wait [SECONDS]"; exit 2 ;;
esac
