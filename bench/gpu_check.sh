#!/usr/bin/env bash
# What a GPU session runs first, in one device call (nvidia-h200-x2): the cuda-marked tests, then the
# profile that explains the engine's throughput gap. Logs and JSON lines go under $OUT (or ./gpu_out).
# Each step has its own time limit, so one hang cannot eat the call.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
out="${OUT:-gpu_out}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"

timeout "${TESTS_S:-300}" python3 -m pytest -m cuda -q -p no:cacheprovider -W ignore tests/ > "$out/gpu_tests.log" 2>&1
echo "cuda tests rc=$?"; grep -E "passed|failed|error" "$out/gpu_tests.log" | tail -3; grep -E "^FAILED|^ERROR" "$out/gpu_tests.log" | head

timeout "${PROFILE_S:-240}" python3 bench/profile_step.py --rows "${PROFILE_ROWS:-plain_4,fsdp2_4,fsdp2_4_ragged}" \
    > "$out/profile.txt" 2>&1
echo "profile rc=$?"; grep -A14 "====" "$out/profile.txt" | cut -c1-60,100-170 | head -60
