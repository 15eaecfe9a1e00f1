"""The packages of tritonllm stand in layers: pyproject.toml's [tool.importlinter] contract holds.

Each package imports only the packages below it (docs/ARCHITECTURE.md lists the order), imports
inside functions included. The check is import-linter's `lint-imports` on pyproject.toml; it finds
`tritonllm` as Python imports it (the editable install maps it to backend/), and a broken contract
fails this test with import-linter's report: each forbidden import, its file and line.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]
# lint-imports itself, on this interpreter (its console script need not be on PATH).
LINT_IMPORTS = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"


def test_packages_keep_their_layers():
    pytest.importorskip("importlinter", reason="import-linter is in the test extra: pip install -e '.[test]'")
    # --no-cache: nothing is written into the repository.
    result = subprocess.run([sys.executable, "-c", LINT_IMPORTS, "--no-logo", "--no-cache", "pyproject.toml"],
                            cwd=REPO, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        pytest.fail(f"import-linter: the layers contract is broken\n{result.stdout}\n{result.stderr}", pytrace=False)
    assert "1 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize("module", ["tritonllm.serving.generate_model", "tritonllm.serving.embedding_model"])
def test_the_model_glue_imports_no_torch_until_initialize(module):
    """Triton starts a stub of its own only to call auto_complete_config, before the one that serves: importing
    the glue for that must not import torch (a second of every model load); initialize() imports the engine."""
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]", f"{module} imports {result.stdout.strip()} at import time"
