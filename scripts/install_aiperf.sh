#!/usr/bin/env bash
# Install NVIDIA's AIPerf benchmark into .venv-aiperf/ in the repository root, apart from .venv/:
# aiperf 0.13 needs numpy 2 and protobuf 7, while the Triton Python-backend stub needs numpy 1.x
# (tritonserver_process.check_numpy) and tritonclient protobuf 6. Idempotent: a matching install is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
version="0.13.0"
python="${PYTHON:-python3}"
if [ -x .venv-aiperf/bin/aiperf ] && .venv-aiperf/bin/python -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('aiperf') != '$version')" 2>/dev/null; then
  exit 0
fi
if [ ! -x .venv-aiperf/bin/python ]; then
  "$python" -m venv .venv-aiperf
fi
.venv-aiperf/bin/python -m pip install --quiet --upgrade pip
.venv-aiperf/bin/python -m pip install --quiet "aiperf==$version"
.venv-aiperf/bin/aiperf --version
