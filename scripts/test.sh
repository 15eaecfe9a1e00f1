#!/usr/bin/env bash
# Install what is needed (test extras) and run the whole test suite; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# AIPerf (its own venv, for the OpenAI API's smoke run in tests/test_openai_api.py) shares nothing with
# .venv: it downloads while install.sh compiles the CPU kernels.
aiperf_log="$(mktemp)"
bash scripts/install_aiperf.sh >"$aiperf_log" 2>&1 &
aiperf_install=$!
# The tests run on this CPU only: the kernel variants it cannot run would be built for nothing.
TRITONLLM_KERNEL_BUILD=runnable bash scripts/install.sh test
if ! wait "$aiperf_install"; then
  cat "$aiperf_log" >&2; rm -f "$aiperf_log"
  echo "test.sh: installing AIPerf failed (scripts/install_aiperf.sh)" >&2
  exit 1
fi
cat "$aiperf_log"; rm -f "$aiperf_log"
. .venv/bin/activate
python -m tritonllm.models.model_files >/dev/null  # convert the packaged model once (cached)
exec python -m pytest "$@"
