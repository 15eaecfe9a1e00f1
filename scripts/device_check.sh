#!/usr/bin/env bash
# On a machine with an NVIDIA GPU (or an Ascend NPU): the device backend against transformers on the
# device, a served stream and a cancelled one on the device's config variant, then the burst and
# decode-heavy benchmarks beside vLLM's GPU build where it installs, async scheduling against the
# synchronous loop, response coalescing, and FP8 weights and KV cache (accuracy and time). What it shows goes to
# results/device-check/; record it in docs/DEVICES.md.
#   bash scripts/device_check.sh            # tests and benchmarks
#   bash scripts/device_check.sh --tests    # tests only
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/device-check
mkdir -p "$out"
bash scripts/install.sh test
. .venv/bin/activate
device=$(python - <<'PY'
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
  pip install --quiet ".[cuda]" || echo "device_check: flashinfer did not install; the torch reference attention runs" | tee -a "$out/device.txt"
else
  npu-smi info | tee "$out/device.txt" || true
fi
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/device.txt"
python -m tritonllm.models.model_files >/dev/null
python -m pytest -v -rs tests/test_devices.py tests/test_attention_layouts.py tests/test_fp8.py 2>&1 | tee "$out/tests.log"
[ "${1:-}" = "--tests" ] && exit 0

vllm_args=()
if [ "$device" = cuda ]; then
  # vLLM's GPU build in a venv of its own, beside ours.
  if [ ! -x "$HOME/.venvs/vllm-gpu/bin/python" ]; then
    python3 -m venv "$HOME/.venvs/vllm-gpu" && "$HOME/.venvs/vllm-gpu/bin/pip" install --quiet vllm \
      || echo "device_check: vLLM did not install" | tee -a "$out/device.txt"
  fi
  [ -x "$HOME/.venvs/vllm-gpu/bin/python" ] && vllm_args=(--vllm-python "$HOME/.venvs/vllm-gpu/bin/python" --vllm-dtype bfloat16)
fi
for scenario in burst seed_replay_saturating; do
  python bench/compare.py --scenario "loadtest/scenarios/$scenario.yaml" --systems ours,vllm --concurrency none \
    --decode-steps 0 --ours-config "$device" "${vllm_args[@]}" --out "$out/$scenario" 2>&1 | tee "$out/$scenario.log"
done
# The engine without a server against transformers on the same device (and its reference attention).
variant=cuda_attention=torch
[ "$device" = npu ] && variant=npu_attention=torch
python bench/offline_engine.py --device "$device" --dtype bfloat16 --variant "$variant" \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine.log"
# Async scheduling (on by default here) against the synchronous loop, with each run's per-step breakdown.
python bench/offline_engine.py --device "$device" --dtype bfloat16 --variant async_scheduling=false --no-transformers \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine_async.log"
# The served burst with one response per token, the responses built when their sender thread reaches
# them (response_coalescing) against one response per token each.
python bench/compare.py --scenario loadtest/scenarios/burst.yaml --systems ours --concurrency none --decode-steps 0 \
  --ours-config "$device" --ours-param response_coalescing=true --out "$out/burst_coalescing" 2>&1 | tee "$out/burst_coalescing.log"
# FP8 weights (torch._scaled_mm) and an FP8 KV cache: what they cost in accuracy against bfloat16, and in time.
python bench/quantization_accuracy.py --device "$device" --dtype bfloat16 --variant quantization=fp8 \
  --variant kv_cache_dtype=fp8 --variant quantization=fp8,kv_cache_dtype=fp8 2>&1 | tee "$out/quantization_accuracy.log"
python bench/offline_engine.py --device "$device" --dtype bfloat16 --variant quantization=fp8 --no-transformers \
  loadtest/scenarios/burst.yaml loadtest/scenarios/seed_replay_saturating.yaml 2>&1 | tee "$out/offline_engine_fp8.log"
