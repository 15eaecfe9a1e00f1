#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (or an Ascend NPU): the device backend against transformers on the
# device, a served stream and a cancelled one on the device's config variant, then the benchmarks: the
# offline decode step with async scheduling against the synchronous loop, the served burst (one response
# per token, and with response coalescing), FP8 weights and KV cache (accuracy and time), the decode-heavy
# replay, and vLLM's GPU build beside ours where it installs. What it shows goes to results/device-check/
# (and, where $OUT is set, as one results/device-check-<stage>.tar.gz under it); record it in docs/DEVICES.md.
#   bash scripts/device_check.sh            # tests, then benchmarks
#   bash scripts/device_check.sh --tests    # tests only
#   bash scripts/device_check.sh --bench    # benchmarks only
#   DEVICE_BENCH="decode profile served" bash scripts/device_check.sh --bench   # only these benchmarks
# The benchmarks, in this order: decode (the offline step, async against synchronous), profile (the same
# under torch's profiler), served (the burst, one response per token and coalesced), fp8 (accuracy and
# time), saturating (the served replay, beside vLLM where it installs), transformers (the engine against
# transformers on the device).
# On a machine without a package registry, the wheels its image lacks come from scripts/device_bundle.sh:
# where .device/bundle.tar.part-* is present they are installed from there into the image's Python, nothing
# is downloaded and vLLM is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:-all}"
case "$stage" in all | --tests | --bench) ;; *) echo "usage: $0 [--tests|--bench]" >&2; exit 2 ;; esac
out=results/device-check
mkdir -p "$out"
pack() {  # what this stage wrote, as one file under $OUT (the device tool brings back a few files only)
  [ -n "${OUT:-}" ] && tar -czf "$OUT/device-check-${stage#--}.tar.gz" -C results device-check || true
}
trap pack EXIT

offline=false
if compgen -G ".device/bundle.tar.part-*" >/dev/null; then
  # Into the image's own Python environment (this machine is disposable): tritonserver's stubs take their
  # packages from the `python` first on PATH, not from PYTHONPATH.
  offline=true
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  if [ ! -e "$site/.tritonllm-device-bundle" ]; then
    rm -rf /tmp/bundle && mkdir -p /tmp/bundle
    cat .device/bundle.tar.part-* | tar -C /tmp/bundle -xf -
    pip_args=(--quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade)
    # A system Python (not a venv) refuses installs without this, where pip knows it (23.0.1 and later).
    python3 -m pip install --help | grep -q -- --break-system-packages && pip_args+=(--break-system-packages)
    python3 -m pip install "${pip_args[@]}" /tmp/bundle/wheels/*.whl
    # numpy 1.26 (for the stubs) replaced the image's numpy 2: packages built against numpy 2 that
    # transformers imports wherever they are installed (scipy, scikit-learn) would fail its model imports.
    uninstall_args=(-y --quiet)
    [[ " ${pip_args[*]} " == *" --break-system-packages "* ]] && uninstall_args+=(--break-system-packages)
    python3 -m pip uninstall "${uninstall_args[@]}" scipy scikit-learn scikit-image statsmodels 2>/dev/null || true
    touch "$site/.tritonllm-device-bundle"
  fi
  # The packages as pyproject.toml maps them, without building them.
  ln -sfn "$PWD/backend" "$site/tritonllm"
  ln -sfn "$PWD/client" "$site/tritonllm_client"
else
  bash scripts/install.sh test
  . .venv/bin/activate
fi
device=$(python3 - <<'PY'
import torch
try:
    import torch_npu  # noqa: F401
    npu = torch.npu.is_available()
except ImportError:
    npu = False
print("npu" if npu else "cuda" if torch.cuda.is_available() else "none")
PY
)
if [ "$device" = none ]; then
  echo "device_check: no CUDA GPU or Ascend NPU visible to torch here" >&2
  exit 1
fi
if [ "$device" = cuda ]; then
  nvidia-smi | tee "$out/device.txt"
  if [ "$offline" = false ]; then
    pip install --quiet ".[cuda]" || echo "device_check: flashinfer did not install; the torch reference attention runs" | tee -a "$out/device.txt"
  fi
else
  npu-smi info | tee "$out/device.txt" || true
fi
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
python3 -c "import flashinfer; print('flashinfer', flashinfer.__version__)" 2>&1 | tail -1 | tee -a "$out/device.txt" || true
python3 -m tritonllm.models.model_files >/dev/null
if [ "$stage" != --bench ]; then
  python3 -m pytest -v -rs --durations=15 -p no:cacheprovider tests/test_devices.py tests/test_attention_layouts.py tests/test_fp8.py \
    tests/test_async_scheduling.py 2>&1 | tee "$out/tests.log"
fi
[ "$stage" = --tests ] && exit 0
want() { [[ " ${DEVICE_BENCH:-decode profile served fp8 saturating transformers} " == *" $1 "* ]]; }

# First what the targets are measured by (docs/DEVICES.md): the offline decode step with its per-step
# breakdown, async scheduling against the synchronous loop.
want decode && python3 bench/offline_engine.py --device "$device" --dtype bfloat16 --param async_scheduling=true \
  --variant async_scheduling=false --no-transformers \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine_async.log"
# Where the step's host time goes: the engine's named ranges and torch's profiler tables (the profiler's
# own overhead included), with how many steps replayed a decode graph.
want profile && python3 bench/offline_engine.py --device "$device" --dtype bfloat16 --no-transformers --profile \
  loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine_profile.log"
# The served burst with one response per token, then with each stream's responses built when its sender
# thread reaches them (response_coalescing).
want served && python3 bench/compare.py --scenario loadtest/scenarios/burst.yaml --systems ours --concurrency none \
  --decode-steps 0 --ours-config "$device" --out "$out/burst" 2>&1 | tee "$out/burst.log"
want served && python3 bench/compare.py --scenario loadtest/scenarios/burst.yaml --systems ours --concurrency none --decode-steps 0 \
  --ours-config "$device" --ours-param response_coalescing=true --out "$out/burst_coalescing" 2>&1 | tee "$out/burst_coalescing.log"
# FP8 weights (torch._scaled_mm) and an FP8 KV cache: what they cost in accuracy against bfloat16, and in time.
want fp8 && python3 bench/quantization_accuracy.py --device "$device" --dtype bfloat16 --variant quantization=fp8 \
  --variant kv_cache_dtype=fp8 --variant quantization=fp8,kv_cache_dtype=fp8 2>&1 | tee "$out/quantization_accuracy.log"
want fp8 && python3 bench/offline_engine.py --device "$device" --dtype bfloat16 --variant quantization=fp8 --no-transformers \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine_fp8.log"
# Served, beside vLLM's GPU build in a venv of its own where a registry is at hand.
vllm_args=() systems=ours
if want saturating && [ "$device" = cuda ] && [ "$offline" = false ]; then
  if [ ! -x "$HOME/.venvs/vllm-gpu/bin/python" ]; then
    python3 -m venv "$HOME/.venvs/vllm-gpu" && "$HOME/.venvs/vllm-gpu/bin/pip" install --quiet vllm \
      || echo "device_check: vLLM did not install" | tee -a "$out/device.txt"
  fi
  if [ -x "$HOME/.venvs/vllm-gpu/bin/python" ]; then
    vllm_args=(--vllm-python "$HOME/.venvs/vllm-gpu/bin/python" --vllm-dtype bfloat16) systems=ours,vllm
  fi
fi
want saturating && python3 bench/compare.py --scenario loadtest/scenarios/seed_replay_saturating.yaml --systems "$systems" \
  --concurrency none --decode-steps 0 --ours-config "$device" "${vllm_args[@]}" --out "$out/saturating" \
  2>&1 | tee "$out/saturating.log"
if want saturating && [ "$systems" = ours,vllm ]; then
  python3 bench/compare.py --scenario loadtest/scenarios/burst.yaml --systems vllm --concurrency none --decode-steps 0 \
    "${vllm_args[@]}" --out "$out/burst_vllm" 2>&1 | tee "$out/burst_vllm.log"
fi
# Last, as the longest: the engine against transformers on the same device (and its reference attention).
variant=cuda_attention=torch
[ "$device" = npu ] && variant=npu_attention=torch
want transformers && python3 bench/offline_engine.py --device "$device" --dtype bfloat16 --variant "$variant" \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine.log"
exit 0  # a benchmark left out above is not a failure
