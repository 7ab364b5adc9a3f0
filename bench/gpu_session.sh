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

collect() {
    local out=${OUT:-gpu_out}
    mkdir -p "$out"
    cp "$GS/session.log" "$out/" 2>/dev/null
    cp "$RES" "$out/" 2>/dev/null
    tar czf "$out/logs.tar.gz" -C "$GS" . 2>/dev/null
    echo "---- session"; cat "$GS/session.log"
    echo "---- results"; cat "$RES" 2>/dev/null | cut -c1-400
    for f in "$GS"/*.log; do
        [ "$(basename "$f")" = session.log ] && continue
        echo "---- $(basename "$f") (tail)"; grep -vE "^\s*$" "$f" | grep -E "passed|failed|FAILED|ERROR|Error|error|rc=" | tail -8
    done
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
