#!/usr/bin/env bash
# The device check of the CUDA backend (issue 25), for a machine with an NVIDIA GPU; under
# 8 minutes in all. Run from anywhere:  bash bench/device_check.sh
#   1. installs the package (pip install ., CUDA kernels for this GPU's architecture only, to
#      keep the build short) - or, when that cannot run (no network for the build requirements),
#      uses a build directory carried along: TENSORFOLD_CORE_DIR=build;
#   2. runs the `gpu` tests (the backend op suites on "cuda", CUDA/CPU model parity);
#   3. a short benchmark (bench/e2e_cuda.py): decode and prefill tok/s on SmolLM2 and on a
#      llama.cpp-quantized Q4_K_M MoE, with the share of the GPU's memory bandwidth reached.
# Models: SmolLM2 from $TENSORFOLD_TEST_MODEL, TensorFold's pull cache, or tensorfold.pull()
# (network); the MoE from $MOE_GGUF, else made here: bench/make_synthetic_moe.py (F16, 1.5 GB) then
# llama-quantize Q4_K_M when $LLAMA_BIN holds it, else `tensorfold quantize` to a Q4_K/Q6_K mix
# of the same size (said so in the output).
set -uo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
cd "$SRC"
T0=$(date +%s)
elapsed() { echo "[$(( $(date +%s) - T0 )) s] $*"; }
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/tf-device-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "nvidia-smi: not available"

# -- 1. install -------------------------------------------------------------------------------
CC=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d '. ')
export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
[ -n "$CC" ] && export TENSORFOLD_CUDA_ARCHS="$CC"
if [ -n "${TENSORFOLD_CORE_DIR:-}" ] && [ -e "${TENSORFOLD_CORE_DIR}" ]; then
  TENSORFOLD_CORE_DIR=$(cd "$TENSORFOLD_CORE_DIR" && pwd); export TENSORFOLD_CORE_DIR
  export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}"
  elapsed "using the carried build $TENSORFOLD_CORE_DIR"
elif timeout 300 $PY -m pip install -q --no-build-isolation --no-deps . > "$OUT/pip.log" 2>&1 \
    || timeout 300 $PY -m pip install -q . >> "$OUT/pip.log" 2>&1; then
  elapsed "installed (CUDA archs ${TENSORFOLD_CUDA_ARCHS:-default})"
  cd "$OUT"  # import the installed package, not the source tree
else
  tail -30 "$OUT/pip.log"; elapsed "pip install failed"; exit 1
fi
$PY - <<'PY' || exit 1
from tensorfold import _core
c = _core.cuda
print(f"built_with_cuda={c.built_with_cuda()} archs={c.compiled_archs()} devices={c.device_count()} note={c.build_note()!r}")
assert c.built_with_cuda() and c.device_count() > 0, "no CUDA here"
print(c.device_info(0))
PY

# -- models -----------------------------------------------------------------------------------
SMOL=${TENSORFOLD_TEST_MODEL:-}
[ -z "$SMOL" ] && SMOL=$($PY -c "import tensorfold; print(tensorfold.pull('smollm2-135m-instruct'))" 2>/dev/null | tail -1)
if [ -n "$SMOL" ] && [ -e "$SMOL" ]; then export TENSORFOLD_TEST_MODEL=$SMOL; else SMOL=""; echo "SmolLM2: not available (no network, no TENSORFOLD_TEST_MODEL)"; fi

# -- 2. gpu tests -----------------------------------------------------------------------------
elapsed "pytest -m gpu"
(cd "$SRC" && timeout 210 $PY -m pytest -q -m gpu -p no:cacheprovider tests -rs 2>&1 | tail -40)
elapsed "every backend against transformers (llama, qwen3moe)"
(cd "$SRC" && timeout 120 $PY -m pytest -q -p no:cacheprovider tests/test_hf_parity.py -k "every_backend and (llama or qwen3moe)" 2>&1 | tail -5)
elapsed "tests done"

# -- 3. benchmark -----------------------------------------------------------------------------
MOE=${MOE_GGUF:-}
if [ -z "$MOE" ]; then
  F16="$OUT/synth-moe-f16.gguf"
  [ -e "$F16" ] || timeout 120 $PY "$SRC/bench/make_synthetic_moe.py" -o "$F16" --outtype f16 --size-gb 1.5 \
      --threads "$(nproc)" > "$OUT/gen.log" 2>&1 || { tail -5 "$OUT/gen.log"; F16=""; }
  if [ -n "$F16" ] && [ -n "${LLAMA_BIN:-}" ] && [ -x "$LLAMA_BIN/llama-quantize" ]; then
    MOE="$OUT/synth-moe-Q4_K_M.gguf"
    timeout 120 "$LLAMA_BIN/llama-quantize" "$F16" "$MOE" Q4_K_M "$(nproc)" > "$OUT/quant.log" 2>&1 \
      && echo "MoE: llama.cpp Q4_K_M" || { tail -5 "$OUT/quant.log"; MOE=""; }
  elif [ -n "$F16" ]; then
    MOE="$OUT/synth-moe-q4k-mix.gguf"
    echo "MoE: llama-quantize not available (LLAMA_BIN); tensorfold quantize to a Q4_K/Q6_K mix at 4.85 bpw instead"
    timeout 150 $PY -m tensorfold quantize "$F16" -o "$MOE" --target-bpw 4.85 --types Q4_K,Q6_K \
      > "$OUT/quant.log" 2>&1 || { tail -5 "$OUT/quant.log"; MOE=""; }
  fi
fi
MODELS=""
[ -n "$SMOL" ] && MODELS="$SMOL"
[ -n "$MOE" ] && [ -e "$MOE" ] && MODELS="$MODELS $MOE"
if [ -n "$MODELS" ]; then
  elapsed "benchmark: $MODELS"
  timeout 150 $PY "$SRC/bench/e2e_cuda.py" $MODELS --reps 2 --json "$OUT/bench.json"
fi
elapsed "device check done"
