#!/usr/bin/env bash
# Install what is needed (test extras) and run the whole test suite; arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh test
bash scripts/install_aiperf.sh  # AIPerf in its own venv, for the OpenAI API's smoke run (tests/test_openai_api.py)
. .venv/bin/activate
python -m tritonllm.models.model_files >/dev/null  # convert the packaged model once (cached)
exec python -m pytest "$@"
