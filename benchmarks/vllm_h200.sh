#!/usr/bin/env bash
# vLLM 0.26 on one H200 for benchmarks/vllm_gpu.py, with no network on the GPU machine.
#
# Here (a machine with PyPI):
#   bash benchmarks/vllm_h200.sh prepare          # .gpu/c1 .gpu/c2 .gpu/c3, under 64 MiB each
#   bash benchmarks/vllm_h200.sh wheel            # this checkout's wheel into .gpu/c3 (again
#                                                 # after every change, before the calls)
# There, three back-to-back calls of one warm machine (files under /tmp survive only while it
# stays warm), each carrying one folder:
#   bash benchmarks/vllm_h200.sh stage .gpu/c1
#   bash benchmarks/vllm_h200.sh stage .gpu/c2
#   bash benchmarks/vllm_h200.sh run .gpu/c3 bf16 fp8        # stages, installs, runs cases
# and more cases in later calls of the same machine: `bash benchmarks/vllm_h200.sh run - moe`
# (`run DIR ...` on a warm machine installs DIR's weight_transfer wheel over the staged one).
# A case may name its updates: `mla:2`; CASE_TIMEOUT_S bounds each case (default 540 s).
# Results go to $OUT (the device tool's folder) or ./vllm_gpu_out.
set -euo pipefail
cd "$(dirname "$0")/.."
cmd=${1:?usage: vllm_h200.sh prepare | wheel | stage DIR | run DIR|- CASE...}
shift
parts=/tmp/wt_vllm/parts
site=/tmp/wt_vllm/site

case "$cmd" in
prepare)
    # vLLM 0.26.0 is the newest release whose wheel pins torch 2.11.0, the torch the H200
    # machine has. Its Hopper-only needs: FlashAttention 3, not 2; no Blackwell FMHA; no Rust
    # front end. Dependencies: what its import and an offline LLM need (found by trial, see
    # ../shared/tools/vllm_h200/README.md), pure wheels or cp312 manylinux.
    out=.gpu
    rm -rf "$out" && mkdir -p "$out/tmp/x" "$out/deps" "$out/c1" "$out/c2" "$out/c3"
    P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_26_x86_64 --platform manylinux_2_24_x86_64
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64
        --platform manylinux_2_34_x86_64)
    python3 -m pip download -q "${P[@]}" -d "$out/tmp" vllm==0.26.0
    deps=(pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection
        typing-extensions msgspec pyzmq cachetools cbor2 pybase64 "openai>=2,<3" jiter distro
        sniffio openai-harmony partial-json-parser "fastapi>=0.133,<0.137" "starlette>=1.0.1"
        blake3 setproctitle compressed-tensors==0.17.0 depyf==0.20.0 astor dill lark==1.2.2
        prometheus-fastapi-instrumentator python-json-logger ijson watchfiles
        "llguidance>=1.7,<1.8" xgrammar outlines_core==0.2.14 lm-format-enforcer==0.11.3
        interegular mistral_common pydantic-extra-types pycountry jsonschema referencing rpds-py
        jsonschema-specifications gguf diskcache "apache-tvm-ffi>=0.1.11" loguru msgpack
        cryptography cffi pycparser)
    for d in "${deps[@]}"; do python3 -m pip download -q "${P[@]}" -d "$out/deps" "$d"; done
    (cd "$out/tmp/x" && unzip -q ../vllm-0.26.0-*.whl &&
        rm -f vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so vllm/vllm-rs &&
        rm -rf vllm/third_party/fmha_sm100 &&
        tar cf - vllm vllm-0.26.0.dist-info | xz -T2 -6 >../vllm.tar.xz)
    (cd "$out" && split -b 45M tmp/vllm.tar.xz part_ && rm -rf tmp)
    mv "$out/part_aa" "$out/c1/" && mv "$out/part_ab" "$out/c2/" && mv "$out/part_ac" "$out/c3/"
    # The dependencies fill the three folders up to about 58 MiB each (the checkout travels too).
    python3 - "$out" <<'EOF'
import os, sys
out = sys.argv[1]
room = {"c1": 8.5 * 2**20, "c2": 8.5 * 2**20, "c3": 60 * 2**20}
wheels = sorted(os.listdir(f"{out}/deps"), key=lambda f: -os.path.getsize(f"{out}/deps/{f}"))
for w in wheels:
    size = os.path.getsize(f"{out}/deps/{w}")
    dest = next(c for c in room if room[c] >= size)
    room[dest] -= size
    os.replace(f"{out}/deps/{w}", f"{out}/{dest}/{w}")
os.rmdir(f"{out}/deps")
EOF
    bash "$0" wheel
    du -sh "$out"/c1 "$out"/c2 "$out"/c3
    ;;
wheel)
    rm -f .gpu/c3/weight_transfer-*.whl
    python3 -m pip wheel -q --no-deps -w .gpu/c3 .
    ls .gpu/c3/weight_transfer-*.whl
    ;;
stage | run)
    dir=${1:?stage/run needs a folder (or - for none)}
    shift
    mkdir -p "$parts"
    if [ "$dir" != - ]; then cp "$dir"/* "$parts"/; fi
    if [ "$cmd" = stage ]; then
        ls "$parts" | wc -l
        exit 0
    fi
    if [ ! -d "$site/vllm" ]; then
        mkdir -p "$site"
        cat "$parts"/part_* | xz -d -T8 | tar x -C "$site"
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target "$site" "$parts"/*.whl
    elif [ "$dir" != - ] && ls "$dir"/weight_transfer-*.whl >/dev/null 2>&1; then
        # A warm machine, a new build of this package carried: it replaces the installed one.
        rm -rf "$site"/weight_transfer "$site"/weight_transfer-*.dist-info
        python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --target "$site" "$dir"/weight_transfer-*.whl
    fi
    export PYTHONPATH=$site PYTHONUNBUFFERED=1
    export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    out=${OUT:-vllm_gpu_out}
    mkdir -p "$out"
    python3 -c "import vllm, torch, weight_transfer; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
    status=0
    # A case is CASE or CASE:STEPS (updates of a colocated case; default 3).
    for arg in "$@"; do
        c=${arg%%:*}
        steps=3
        if [ "$c" != "$arg" ]; then steps=${arg#*:}; fi
        timeout "${CASE_TIMEOUT_S:-540}" python3 -m weight_transfer.benchmarks.vllm_gpu \
            --case "$c" --steps "$steps" --out "$out" \
            2>&1 | tee "$out/vllm_gpu_$c.log" | grep -v -E "(INFO|DEBUG) " || status=1
    done
    exit $status
    ;;
*)
    echo "unknown command $cmd" >&2
    exit 2
    ;;
esac
