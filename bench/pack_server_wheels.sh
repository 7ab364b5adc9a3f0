#!/usr/bin/env bash
# HERE (the development machine, in the repository root, with the project installed): the wheels the device
# image lacks for the server and agent phases (openai, fastapi, uvicorn, httptools, uvloop and what they need, at the versions
# installed here), for Python 3.12 on x86-64, under .whl/oai (git-ignored). THERE, before those phases:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir .whl/oai/*.whl
# (carry=[".whl/oai"]; already-installed packages are left as they are, since there is no --upgrade).
#   bash bench/pack_server_wheels.sh agents openai-agents   # other roots into .whl/agents: the agent frameworks
#   SKIP="torch transformers accelerate peft tokenizers safetensors huggingface-hub numpy" \
#       bash bench/pack_server_wheels.sh trl trl datasets   # bench/learn.py's TRL side, less what the image has
#   SKIP="sympy pyyaml tabulate numpy pillow matplotlib scipy requests mpmath rich pygments six" \
#       bash bench/pack_server_wheels.sh rg reasoning-gym   # the reasoning-gym example (the owed set)
# SKIP: packages (and what only they need) left out: the device's own torch stack stays as it is.
set -eu
dest=.whl/${1:-oai}
roots=${*:2}
roots=${roots:-openai fastapi uvicorn httptools uvloop}
mkdir -p "$dest"
pins=$(ROOTS="$roots" SKIP="${SKIP:-}" python3 - <<'PY'
import importlib.metadata as md, os, re
seen, todo = {}, os.environ["ROOTS"].split()
skip = {n.lower().replace("_", "-") for n in os.environ["SKIP"].split()}
while todo:
    name = todo.pop()
    key = name.lower().replace("_", "-")
    if key in seen or key in skip:
        continue
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        continue
    seen[key] = dist.version
    todo += [re.split(r"[ ;<>=!~\[(]", r)[0] for r in dist.requires or [] if "extra ==" not in r]
print(" ".join(f"{k}=={v}" for k, v in seen.items()))
PY
)
# one at a time: a package published as a source archive alone (zss, cellpylib, pycosat: reasoning-gym's) is built
# into a wheel by a Python 3.12 (PY312; pyenv's python3.12 needs PYENV_VERSION set to its version)
[ -n "$pins" ] || { echo "nothing to pack: none of [$roots] is installed here (install them first)" >&2; exit 1; }
platforms=""
for n in 39 35 34 31 28 27 24 17 12 5; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
for pin in $pins; do
    if ! why=$(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            $platforms --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$dest" "$pin" 2>&1); then
        echo "no binary wheel of $pin to download ($(echo "$why" | grep -m1 ERROR)); building one" >&2
        "${PY312:-python3.12}" -m pip wheel -q --no-deps "$pin" -w "$dest" \
            || { echo "could not build a wheel of $pin with ${PY312:-python3.12} (PY312: a Python 3.12)" >&2; exit 1; }
    fi
done
ls "$dest"
