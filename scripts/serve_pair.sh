#!/usr/bin/env bash
# Two tritonllm-serve servers behind HAProxy on this machine: the scale-out shape of docs/SCALING.md,
# to try a server's death and its return (docs/OPERATIONS.md). Binds 127.0.0.1:
#   balancer: HTTP 8000, gRPC 8001, stats http://127.0.0.1:8404/stats
#   server a: HTTP 8100, gRPC 8101, metrics 8102      server b: HTTP 8200, gRPC 8201, metrics 8202
# Extra arguments go to both tritonllm-serve commands. Ctrl-C (or SIGTERM) drains both servers and stops.
# Needs haproxy (Debian/Ubuntu: apt-get install haproxy). On one machine the two servers share the
# cores; set num_threads in config.pbtxt so that they do not oversubscribe them.
set -euo pipefail
cd "$(dirname "$0")/.."
command -v haproxy >/dev/null || { echo "serve_pair.sh: haproxy not found (apt-get install haproxy)" >&2; exit 1; }
bash scripts/install.sh client
. .venv/bin/activate
python -m tritonllm.models.model_files >/dev/null  # convert the packaged model once, not in both servers

export TRITONLLM_LB_HOST=127.0.0.1 TRITONLLM_LB_HTTP_PORT=8000 TRITONLLM_LB_GRPC_PORT=8001 TRITONLLM_LB_STATS_PORT=8404
export TRITONLLM_A_HTTP=127.0.0.1:8100 TRITONLLM_A_GRPC=127.0.0.1:8101
export TRITONLLM_B_HTTP=127.0.0.1:8200 TRITONLLM_B_GRPC=127.0.0.1:8201

pids=()
stop() {
  trap - INT TERM EXIT
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
}
trap stop INT TERM EXIT

tritonllm-serve --model-repository model_repository --no-prepare \
  --http-port 8100 --grpc-port 8101 --metrics-port 8102 "$@" &
pids+=($!)
tritonllm-serve --model-repository model_repository --no-prepare \
  --http-port 8200 --grpc-port 8201 --metrics-port 8202 "$@" &
pids+=($!)
haproxy -db -f deploy/haproxy.cfg &
pids+=($!)
echo "balancer: gRPC 127.0.0.1:8001, HTTP 127.0.0.1:8000, stats http://127.0.0.1:8404/stats (servers join when ready)"
wait -n "${pids[@]}"  # one of them ended: stop the others too
