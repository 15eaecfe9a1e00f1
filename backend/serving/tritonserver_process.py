"""tritonserver as a child process, from PyPI's nvidia-pytriton wheel: where the binary is, the backend
directory it needs, its environment and command line, and free loopback ports for it.

The wheel ships the server binary, the Python backend and one backend stub per Python version,
but no ready-to-use backend directory and no environment for running the binary outside
PyTriton. This module assembles both. `tritonllm-serve` (launcher.py) and its supervisor
(supervision/supervisor.py) start tritonserver with them; so do the tests' harness and the benchmarks.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import socket
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from pathlib import Path

_INSTALL_HINT = "the tritonserver binary comes from PyPI: pip install --no-deps nvidia-pytriton"
_STUB = "triton_python_backend_stub"


def find_pytriton() -> Path:
    """Return the installed `pytriton` package folder (holding `tritonserver/`), without importing it.

    Importing pytriton would pull in its own dependencies, which we install without (--no-deps).
    """
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"pytriton is not installed; {_INSTALL_HINT}")
    root = Path(list(spec.submodule_search_locations)[0])
    if not (root / "tritonserver" / "bin" / "tritonserver").is_file():
        raise FileNotFoundError(f"{root} has no tritonserver/bin/tritonserver; {_INSTALL_HINT}")
    return root


def check_numpy() -> None:
    """Refuse to run the stub with numpy 2, which it silently misreads.

    The stubs in nvidia-pytriton 0.7.0 are built with a pybind11 that predates numpy 2's
    changed dtype layout: every input tensor then reads as copies of its first element
    ([1, 2, 3] arrives as [1, 1, 1]) and STRING inputs crash the stub. numpy 1.26 works.
    """
    try:
        version = importlib.metadata.version("numpy")
    except importlib.metadata.PackageNotFoundError:
        return
    if int(version.split(".")[0]) >= 2:
        raise RuntimeError(
            f"numpy {version} is installed, but the Triton Python backend stub of nvidia-pytriton "
            "is built for numpy 1.x (inputs arrive corrupted, STRING inputs crash it): "
            "pip install 'numpy<2'"
        )


def tritonserver_binary() -> Path:
    """Path of the `tritonserver` executable inside the pytriton wheel."""
    return find_pytriton() / "tritonserver" / "bin" / "tritonserver"


def default_backend_dir() -> Path:
    """$TRITONLLM_BACKEND_DIR, else `.triton/backends`, resolved against the current directory."""
    return Path(os.environ.get("TRITONLLM_BACKEND_DIR", ".triton/backends")).resolve()


def _up_to_date(src: Path, dst: Path) -> bool:
    # copy2 keeps the mtime, so equal size and mtime means this very file was copied already.
    if not dst.is_file():
        return False
    a, b = src.stat(), dst.stat()
    return a.st_size == b.st_size and int(a.st_mtime) == int(b.st_mtime)


def assemble_backend_dir(dest: Path | None = None) -> Path:
    """Make `dest/python/` hold the Python backend plus the stub for this interpreter; return `dest`.

    The Python backend looks for `triton_python_backend_stub` next to `libtriton_python.so`, and
    the wheel keeps the stubs apart (one per Python version), so they must be put together.
    Files already copied and unchanged are skipped, so calling this on every start is cheap.
    """
    dest = Path(dest) if dest is not None else default_backend_dir()
    tritonserver = find_pytriton() / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = tritonserver / "python_backend_stubs" / version / _STUB
    if not stub.is_file():
        raise FileNotFoundError(f"nvidia-pytriton has no Python backend stub for Python {version}")
    src_dir, out_dir = tritonserver / "backends" / "python", dest / "python"
    files = [(p, out_dir / p.relative_to(src_dir)) for p in src_dir.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts]
    files.append((stub, out_dir / _STUB))
    for src, dst in files:
        if _up_to_date(src, dst):
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        # Copy to a temporary name and rename, so a concurrent server never sees half a file.
        tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
        shutil.copy2(src, tmp)
        os.replace(tmp, dst)
    (out_dir / _STUB).chmod(0o755)
    return dest


def server_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for tritonserver: our libpython and the wheel's shared libraries, our venv on PATH."""
    env = dict(os.environ if base is None else base)
    # The stub links libpython3.X.so.1.0. The system's copy can be a different patch release
    # than the interpreter our venv is made from, and then `import ssl` (so transformers) fails
    # inside the stub with `undefined symbol: _PyModule_Add`; so our interpreter's LIBDIR goes
    # first. The wheel's own libraries (libcurl, libb64, ...) live in nvidia_pytriton.libs.
    libs = [sysconfig.get_config_var("LIBDIR") or "", str(find_pytriton().parent / "nvidia_pytriton.libs")]
    libs += [p for p in env.get("LD_LIBRARY_PATH", "").split(os.pathsep) if p]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(dict.fromkeys(p for p in libs if p))
    # The stub's embedded interpreter finds its site-packages from the `python` first on PATH;
    # with the venv's bin/ first it sees torch, transformers and tritonllm.
    paths = [os.path.dirname(sys.executable)] + [p for p in env.get("PATH", "").split(os.pathsep) if p]
    env["PATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def build_command(model_repository: str | Path, http_port: int, grpc_port: int, metrics_port: int,
                  host: str = "127.0.0.1", backend_dir: str | Path | None = None, log_verbose: int = 0,
                  extra_args: Sequence[str] = ()) -> list[str]:
    """The tritonserver command line; `extra_args` come last, so they override ours.

    --exit-on-error is left at its default (true): a model that fails to load stops the
    server at once instead of leaving a server that answers but cannot serve.
    """
    backend_dir = Path(backend_dir) if backend_dir is not None else default_backend_dir()
    return [
        str(tritonserver_binary()),
        f"--model-repository={Path(model_repository).resolve()}",
        f"--backend-directory={Path(backend_dir).resolve()}",
        # The default (/opt/tritonserver/caches) does not exist; this makes --cache-config usable.
        f"--cache-directory={find_pytriton() / 'tritonserver' / 'caches'}",
        f"--http-address={host}", f"--http-port={http_port}",
        f"--grpc-address={host}", f"--grpc-port={grpc_port}",
        f"--metrics-address={host}", f"--metrics-port={metrics_port}",
        f"--log-verbose={log_verbose}",
        *extra_args,
    ]


def free_port() -> int:
    """A loopback TCP port that is free now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pick_ports(*wanted: int | None) -> list[int]:
    """Keep the given ports; replace each None by a free loopback port not already chosen."""
    chosen: list[int] = []
    for port in wanted:
        if port is None:
            port = free_port()
            # Bounded: the kernel handing out a port chosen a moment ago is rare.
            for _ in range(100):
                if port not in chosen:
                    break
                port = free_port()
        chosen.append(port)
    return chosen
