"""Paths that pyproject.toml, README.md and docs/*.md name still exist (after files move, say).

What is checked, relative to the repository root unless said otherwise:

- pyproject.toml: each `package-dir` folder; each of `packages` as a folder with an `__init__.py`
  (through package-dir), or as a folder of data files only where `package-data` names it, and every such folder under a package-dir root listed there (a package not
  listed is left out of a wheel); each `package-data` glob matches at least one file; each
  `[project.scripts]` entry's module exists and defines its function; and each repository path the
  file names in its text, comments included (rule A below).
- README.md and docs/*.md (not docs/results/, which are runs' outputs), in inline code (`...`) and
  fenced code blocks:
  A. a token that starts with a top-level folder of the repository (`backend/`, `bench/`,
     `scripts/`, `tests/`, `model_repository/`, `deploy/`, `docs/`, `client/`, `loadtest/`) is a
     path from the root: `bench/compare.py`, `deploy/Dockerfile`;
  B. a token that starts with a package folder of backend/ (`serving/`, `devices/`, `engine/`, ...)
     is a path under backend/, as the docs write the source tree: `devices/cpu/backend.py`.
  A token is a run of letters, digits, `_`, `.`, `/` and `-` holding a `/`; trailing punctuation is
  dropped. Bare file names (`engine.py`) and paths relative to something else (`configs/cuda.pbtxt`)
  are not checked: they name no place by themselves. A path component written in capitals
  (`configs/NAME.pbtxt`) is a placeholder: it passes where some file matches it as a wildcard.
- Markdown link targets in those files, relative to the linking file (web addresses and `#anchors`
  left out).
- bench/*.py, read without running them: each `import tritonllm.x` / `import tritonllm_client.x`
  names a module that exists (importlib.util.find_spec), and each `from tritonllm.x import y` a module
  that exists and defines y (or has a submodule y), read from the module's source; imports inside
  functions and under try/except included. The same for the bench's own modules
  (`from prompt_tokens import ...`). That the scripts start is tests/test_bench_scripts.py.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parent.parent
TOP_FOLDERS = ("backend", "bench", "scripts", "tests", "model_repository", "deploy", "docs", "client", "loadtest")
BACKEND_PACKAGES = tuple(sorted(p.name for p in (REPO / "backend").iterdir() if (p / "__init__.py").is_file()))
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

FENCED = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)\s]+)\)")
TOKEN = re.compile(r"[\w./-]*/[\w./-]*")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]+$")  # NAME in configs/NAME.pbtxt


def _exists(path: str, base: Path) -> bool:
    if (base / path).exists():
        return True
    parts = path.rstrip("/").split("/")
    stems = [part.split(".")[0] for part in parts]
    if not any(PLACEHOLDER.match(stem) for stem in stems):
        return False
    pattern = "/".join("*" + part[len(stem):] if PLACEHOLDER.match(stem) else part for part, stem in zip(parts, stems))
    return any(base.glob(pattern))


def _missing_paths(text: str) -> list[str]:
    """The tokens of `text` that rule A or B makes paths and that do not exist."""
    missing = []
    for token in TOKEN.findall(text):
        token = token.rstrip(".,:;")
        first = token.split("/", 1)[0]
        if first in TOP_FOLDERS:
            base = REPO
        elif first in BACKEND_PACKAGES:
            base = REPO / "backend"
        else:
            continue
        if not _exists(token, base):
            missing.append(token if base == REPO else f"{token} (under backend/)")
    return missing


def _load_pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _package_folder(package: str, package_dir: dict[str, str]) -> Path:
    """A package's folder, through setuptools' package-dir (the longest matching prefix)."""
    parts = package.split(".")
    for k in range(len(parts), 0, -1):
        prefix = ".".join(parts[:k])
        if prefix in package_dir:
            return REPO / package_dir[prefix] / Path(*parts[k:])
    return REPO / Path(*parts)


def test_pyproject_package_dirs_packages_and_package_data_exist():
    setuptools = _load_pyproject()["tool"]["setuptools"]
    package_dir = setuptools["package-dir"]
    problems = [f"package-dir {name!r}: no folder {folder}" for name, folder in package_dir.items()
                if not (REPO / folder).is_dir()]
    listed = set(setuptools["packages"])
    data_folders = set(setuptools.get("package-data", {}))
    for package in sorted(listed):
        folder = _package_folder(package, package_dir)
        if package in data_folders and not (folder / "__init__.py").exists():  # a folder of data files only
            if not folder.is_dir() or any(folder.glob("*.py")):
                problems.append(f"packages: data folder {package} ({folder.relative_to(REPO)}) is missing or holds "
                                "Python files without an __init__.py")
        elif not (folder / "__init__.py").is_file():
            problems.append(f"packages: {package} has no {folder.relative_to(REPO)}/__init__.py")
    for name, folder in package_dir.items():
        for init in sorted((REPO / folder).rglob("__init__.py")):
            package = ".".join([name, *init.parent.relative_to(REPO / folder).parts])
            if package not in listed and "__pycache__" not in init.parts:
                problems.append(f"packages: {package} ({init.parent.relative_to(REPO)}) is not listed: a wheel would leave it out")
    for package, globs in setuptools.get("package-data", {}).items():
        for pattern in globs:
            if not any(_package_folder(package, package_dir).glob(pattern)):
                problems.append(f"package-data: {package} {pattern!r} matches no file")
    assert not problems, "pyproject.toml:\n" + "\n".join(problems)


def test_pyproject_scripts_name_existing_functions():
    problems = []
    for script, target in _load_pyproject()["project"]["scripts"].items():
        module, _, function = target.partition(":")
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            problems.append(f"{script}: no module {module}")
        elif function not in _top_level_names(Path(spec.origin)):
            problems.append(f"{script}: {module} defines no {function}")
    assert not problems, "pyproject.toml [project.scripts]:\n" + "\n".join(problems)


def test_pyproject_names_only_existing_paths():
    missing = _missing_paths((REPO / "pyproject.toml").read_text())
    assert not missing, "pyproject.toml names paths that do not exist: " + ", ".join(missing)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_name_only_existing_paths(doc: Path):
    text = doc.read_text()
    code = [m.group(0) for m in FENCED.finditer(text)] + INLINE.findall(FENCED.sub("", text))
    missing = [path for chunk in code for path in _missing_paths(chunk)]
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        target = target.split("#", 1)[0]
        if not (doc.parent / target).exists():
            missing.append(f"{target} (link)")
    assert not missing, f"{doc.relative_to(REPO)} names paths that do not exist: " + ", ".join(dict.fromkeys(missing))


def _top_level_names(path: Path) -> set[str]:
    """What a module defines at its top level (functions, classes, assignments, imports), read without running it."""
    names: set[str] = set()

    def visit(body):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):  # `if TYPE_CHECKING:`, try/except ImportError
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit(getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)

    visit(ast.parse(path.read_text()).body)
    return names


BENCH = sorted((REPO / "bench").glob("*.py"))


def _defines(module: str, name: str) -> bool:
    """Whether `from module import name` finds name: a submodule, or a name the module's source defines."""
    if _is_package(module) and importlib.util.find_spec(f"{module}.{name}") is not None:
        return True
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        return False
    source = Path(spec.origin)
    names = _top_level_names(source)
    if name in names:
        return True
    # `from x import *` or a module __getattr__ defines names only when run: import it to see.
    tree = ast.parse(source.read_text())
    if "__getattr__" in names or any(isinstance(n, ast.ImportFrom) and any(a.name == "*" for a in n.names)
                                     for n in tree.body):
        return hasattr(importlib.import_module(module), name)
    return False


def _is_package(module: str) -> bool:
    spec = importlib.util.find_spec(module)
    return spec is not None and spec.submodule_search_locations is not None


@pytest.mark.parametrize("script", BENCH, ids=lambda p: p.name)
def test_bench_imports_resolve(script: Path):
    """Each tritonllm, tritonllm_client and bench-local import of the script names what exists today."""
    local = {p.stem: p for p in BENCH}
    problems = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                if top in ("tritonllm", "tritonllm_client") and importlib.util.find_spec(alias.name) is None:
                    problems.append(f"line {node.lineno}: import {alias.name}: no such module")
                elif top in local and alias.name != top:
                    problems.append(f"line {node.lineno}: import {alias.name}: bench/{top}.py is no package")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in ("tritonllm", "tritonllm_client"):
                if importlib.util.find_spec(node.module) is None:
                    problems.append(f"line {node.lineno}: from {node.module}: no such module")
                    continue
                missing = [a.name for a in node.names if a.name != "*" and not _defines(node.module, a.name)]
            elif top in local and node.module == top:
                defined = _top_level_names(local[top])
                missing = [a.name for a in node.names if a.name != "*" and a.name not in defined]
            else:
                continue
            problems += [f"line {node.lineno}: from {node.module} import {name}: {node.module} has no {name}"
                         for name in missing]
    assert not problems, f"bench/{script.name}:\n" + "\n".join(problems)
