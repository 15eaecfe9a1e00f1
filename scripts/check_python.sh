#!/usr/bin/env bash
# Check tritonllm on another Python than the one scripts/install.sh uses: scripts/check_python.sh 3.10
#
# pyproject.toml promises Python >= 3.10 (NGC tritonserver 24.x containers run 3.10), but the test
# suite runs on one interpreter only. This checks, in a throw-away virtual environment on the
# requested interpreter (found in pyenv, else as pythonX.Y on PATH; CHECK_PYTHON=/path overrides):
#   1. every .py file in backend/, client/ and tests/ compiles (syntax);
#   2. vermin finds no standard-library API or syntax newer than that version (it also covers the
#      modules that need torch, which step 3 cannot import);
#   3. every module of tritonllm and tritonllm_client imports, or fails only for lack of torch or
#      another dependency deliberately left out here; any other error fails the check;
#   4. the unit tests that need no torch and no server pass: the scheduler, the block manager, the
#      model-file cache and the client CLI.
# torch is left out on purpose: for Linux, PyPI has only its CUDA build (0.5 GB for torch alone,
# several GB with its nvidia-* dependencies, 5 GB installed), too much for every CI run.
# The check takes about a minute and a half on 2 cores, most of it pip. Nothing is written to the
# repository.
set -euo pipefail
cd "$(dirname "$0")/.."
version="${1:?usage: scripts/check_python.sh X.Y (e.g. 3.10)}"
[[ "$version" =~ ^3\.[0-9]+$ ]] || { echo "check_python: expected a version like 3.10, got '$version'" >&2; exit 2; }

find_python() {
  if [ -n "${CHECK_PYTHON:-}" ]; then echo "$CHECK_PYTHON"; return; fi
  local root candidate
  root="$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"
  # The newest patch release pyenv has of that version (3.10.13 before 3.10.9: sort -V).
  candidate="$(ls -d "$root/versions/$version".[0-9]* 2>/dev/null | sort -V | tail -n 1)"
  if [ -n "$candidate" ] && [ -x "$candidate/bin/python$version" ]; then
    echo "$candidate/bin/python$version"; return
  fi
  command -v "python$version" || true
}
python="$(find_python)"
# A pyenv shim is on PATH even where its version is not selected, and then fails: run it to know.
if [ -z "$python" ] || ! actual="$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)"; then
  echo "check_python: FAILED: no Python $version interpreter found (pyenv install $version, or set CHECK_PYTHON)" >&2
  exit 1
fi
if [ "$actual" != "$version" ]; then
  echo "check_python: FAILED: $python is Python $actual, not $version" >&2
  exit 1
fi
echo "check_python: Python $version: $python"

SECONDS=0
step() { echo "check_python: [${SECONDS}s] $*"; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
export PYTHONDONTWRITEBYTECODE=1  # keep the checkout free of this interpreter's .pyc files

step "virtual environment"
"$python" -m venv "$tmp/venv"
py="$tmp/venv/bin/python"
# numpy<2 (pyproject's, for the Triton stub) has no wheels for Python 3.13 and later, so there this
# check takes numpy 2 (the modules import the same).
numpy='numpy<2'
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 13))' && numpy='numpy'
# What the torch-free modules and the tests below import, and no more (each package costs time);
# wheels only, so that a missing wheel fails at once instead of building for minutes.
"$py" -m pip install --quiet --quiet --only-binary=:all: --disable-pip-version-check \
  "$numpy" pyyaml "tritonclient[grpc,http]" fastapi uvicorn pytest pytest-timeout vermin==1.9.2

step "compileall"
PYTHONPYCACHEPREFIX="$tmp/pycache" "$py" -m compileall -q backend client tests

step "vermin: no standard library or syntax newer than $version"
# --exclude long: vermin takes torch's Tensor.long() for Python 2's long.
"$tmp/venv/bin/vermin" --quiet --target="$version-" --violations --no-tips --eval-annotations --exclude long \
  backend client

# The packages as pyproject.toml maps them (tritonllm = backend/, tritonllm_client = client/),
# without installing: links in a folder on PYTHONPATH.
mkdir "$tmp/path"
ln -s "$PWD/backend" "$tmp/path/tritonllm"
ln -s "$PWD/client" "$tmp/path/tritonllm_client"
export PYTHONPATH="$tmp/path"

step "import every module"
"$py" - <<'EOF'
import importlib
import pkgutil
import sys

# Dependencies this check does not install (torch, and what needs it or the server); a module may
# fail to import for lack of one of these and nothing else.
LEFT_OUT = {"torch", "torch_npu", "transformers", "tokenizers", "safetensors", "gguf", "accelerate",
            "llguidance", "ninja", "triton_python_backend_utils", "sentence_transformers", "matplotlib",
            "tqdm", "locust", "gevent", "requests", "jinja2", "hypothesis"}
imported, left_out, failed = [], {}, []
for top in ("tritonllm", "tritonllm_client"):
    package = importlib.import_module(top)
    names = [top] + sorted(m.name for m in pkgutil.walk_packages(package.__path__, top + "."))
    for name in names:
        try:
            importlib.import_module(name)
            imported.append(name)
        except ModuleNotFoundError as exc:
            if (exc.name or "").split(".")[0] in LEFT_OUT:
                left_out.setdefault(exc.name.split(".")[0], []).append(name)
            else:
                failed.append(f"{name}: {type(exc).__name__}: {exc}")
        except Exception as exc:  # noqa: BLE001 - any other failure is what this check looks for
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(f"imported {len(imported)} modules; not importable without "
      + ", ".join(f"{dep} ({len(mods)})" for dep, mods in sorted(left_out.items())))
for line in failed:
    print("FAILED to import", line, file=sys.stderr)
sys.exit(1 if failed else 0)
EOF

step "unit tests without torch"
"$py" -m pytest -q -p no:cacheprovider -m unit \
  tests/test_scheduler.py tests/test_block_manager.py tests/test_model_files.py tests/test_client_cli.py
echo "check_python: Python $version OK in ${SECONDS}s"
