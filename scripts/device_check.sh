#!/usr/bin/env bash
# The GPU check: GPU tests, then benchmark tables (printed last), in one device call.
#
# A device call carries at most 64 MiB, the working tree (about 23 MB) included, and the GPU
# box has no internet: the default model's GGUF (98 MB) cannot go. So the check makes models
# with random weights there: one of the default model's shape (SmolLM2-135M, with its real
# tokenizer, carried) and Qwen2.5-Coder 1.5B / 0.5B shapes. The GPU tests compare our engine
# with HF transformers on the same weights (tests/kernels/test_cuda.py, HETEROSPEC_CUDA_MODEL);
# the benchmarks draft a fixed 4 tokens, so they time the mechanism, not a speed-up.
#
#   here, once:    PYTHON=.venv/bin/python bash scripts/device_check.sh prepare
#       writes the git-ignored .devicecarry/: the wheels the box lacks (gguf, xgrammar and its
#       needs, for its Python 3.12) and the default model's tokenizer; prints what a call carries.
#   device call:   bash scripts/device_check.sh run          carry: .devicecarry
#       about 8 minutes (timeout_s 570); results under $OUT: tests.txt, junit.xml, bench.md and
#       each benchmark's log (its rows as they finish, should a timeout cut it short).
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.devicecarry
STAGE=/tmp/heterospec
SITE=$STAGE/site
PY=${PYTHON:-python3}
LIMIT=$((64 * 1024 * 1024))

prepare() {
    set -e
    grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
    rm -rf "$CARRY" && mkdir -p "$CARRY/wheels"
    $PY -c "import sys; from runtime.models.loader import DEFAULT_MODEL, load_tokenizer, resolve_model
load_tokenizer(resolve_model(DEFAULT_MODEL)).save_pretrained(sys.argv[1])" "$CARRY/tokenizer"
    # the GGUF reader, and structured output's grammar library with what it needs
    local pins
    pins=$($PY -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in
        ("gguf", "xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")))')
    # shellcheck disable=SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/wheels" $pins
    du -sh "$CARRY"/*
    local tree carry
    tree=$(git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
    carry=$(du -sb "$CARRY" | cut -f1)
    echo "a device call carries $(( (tree + carry) / 1048576 )) MiB (working tree $(( tree / 1048576 )) MiB," \
         "$CARRY $(( carry / 1048576 )) MiB) of 64 MiB"
    [ $(( tree + carry )) -lt $LIMIT ] || { echo "over the limit: carry less" >&2; exit 1; }
}

run() {
    local out=${OUT:-/tmp/device_check} start=$SECONDS
    [ -d "$CARRY/wheels" ] && [ -d "$CARRY/tokenizer" ] || { echo "no $CARRY: run prepare, then carry it" >&2; exit 2; }
    mkdir -p "$SITE" "$out"
    $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*.whl || exit 1
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    export USE_HUB_KERNELS=NO HETEROSPEC_CUDA_MODEL=$STAGE/smollm2
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, 'cpus', len(__import__('os').sched_getaffinity(0)))"
    $PY -m scripts.make_random_model --shape smollm2-135m --tokenizer "$CARRY/tokenizer" --out "$STAGE/smollm2" \
        && $PY -m scripts.make_random_model --shape qwen2.5-1.5b --out "$STAGE/qwen15" \
        && $PY -m scripts.make_random_model --shape qwen2.5-0.5b --out "$STAGE/qwen05" || exit 1
    echo "== GPU tests ($(( SECONDS - start )) s in)"
    local tests="tests/kernels/test_cuda.py tests/kernels/test_triton_attention.py tests/kernels/test_attention.py"
    local gpus
    gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
    [ "$gpus" -ge 2 ] && tests="$tests tests/engine/test_tensor_parallel_engine.py::test_tp2_on_two_gpus_equals_tp1"
    # shellcheck disable=SC2086
    timeout 200 $PY -m pytest -v -rfE --durations=10 $tests -k "not compile_for_sm90" -p no:cacheprovider \
        --junitxml="$out/junit.xml" > "$out/tests.txt" 2>&1
    local tests_rc=$?
    local status="tests: exit $tests_rc (124: timed out)"
    tail -25 "$out/tests.txt"
    echo "== benchmarks ($(( SECONDS - start )) s in)"
    : > "$out/bench.md"
    local common=(--fixed-speculation 4 --repeats 1 --concurrency 1,16 --kv-cache-memory 8GiB)
    timeout 150 $PY -m scripts.bench_gpu "${common[@]}" --model "$STAGE/smollm2" --draft-model "$STAGE/smollm2" \
        --eagle-head speculators/heads/smollm2-135m-eagle3 --max-tokens 64 \
        --systems plain,plain-eager,lookahead,eagle-target,draft-gpu,draft-cpu-overlap \
        --label "SmolLM2-135M shape, random weights (draft: itself)" 2>"$out/bench_smollm2.log" | tee -a "$out/bench.md"
    status="$status; SmolLM2 benchmark: exit ${PIPESTATUS[0]}"
    timeout 120 $PY -m scripts.bench_gpu "${common[@]}" --model "$STAGE/qwen15" --draft-model "$STAGE/qwen05" \
        --max-tokens 32 --systems plain,draft-gpu,draft-cpu-overlap \
        --label "Qwen2.5 1.5B shape, random weights (draft: 0.5B shape)" 2>"$out/bench_qwen.log" | tee -a "$out/bench.md"
    status="$status; Qwen benchmark: exit ${PIPESTATUS[0]}"
    if [ "$gpus" -ge 2 ]; then  # tensor parallelism over NCCL: TP=1 against TP=2
        timeout 120 $PY -m scripts.bench_tp --device cuda --tp 2 --dtype bfloat16 --model "$STAGE/qwen15" \
            --batch-sizes 1,16 --max-tokens 32 --repeats 1 2>"$out/bench_tp.log" | tee -a "$out/bench.md"
        status="$status; TP benchmark: exit ${PIPESTATUS[0]}"
    fi
    echo; echo "== summary ($(( SECONDS - start )) s): $status"; tail -3 "$out/tests.txt"; cat "$out/bench.md"
    echo "$status" >> "$out/bench.md"
    return $tests_rc
}

case "${1:-run}" in
    prepare) prepare ;;
    run) run ;;
    *) echo "usage: $0 prepare | run" >&2; exit 2 ;;
esac
