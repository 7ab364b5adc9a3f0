#!/usr/bin/env bash
# Unpacks a baseline tree, an older commit's (`git archive -o .whl/base.tar COMMIT`, carried to the device), into the
# folder given, for the bench/run.py steps that run there (`Step.cwd`): figures against it in the same run.
set -euo pipefail
archive="${BASE_TAR:-.whl/base.tar}"
dest="${1:?usage: bench/base_tree.sh FOLDER}"
if [ ! -f "$archive" ]; then
    echo "no baseline tree at $archive: make it with git archive -o $archive COMMIT and carry it" >&2
    exit 2
fi
rm -rf "$dest" && mkdir -p "$dest" && tar -xf "$archive" -C "$dest"
echo "baseline tree $archive unpacked in $dest"
