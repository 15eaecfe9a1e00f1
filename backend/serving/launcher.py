"""Launch a real `tritonserver` with our Python-backend models, from PyPI's nvidia-pytriton wheel.

The wheel ships the server binary, the Python backend and one backend stub per Python version,
but no ready-to-use backend directory and no environment for running the binary outside
PyTriton. This module assembles both. `TritonServer` runs the server for tests and benchmarks;
`main` is the `tritonllm-serve` command, which runs it in the foreground.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import shutil
import shlex
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
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


def _pick_ports(*wanted: int | None) -> list[int]:
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


class TritonServer:
    """A tritonserver child process on loopback, for tests and benchmarks; use as a context manager."""

    def __init__(self, model_repository: str | Path, http_port: int | None = None,
                 grpc_port: int | None = None, metrics_port: int | None = None,
                 log_path: str | Path | None = None, log_verbose: int = 0,
                 extra_args: Sequence[str] = (), env: Mapping[str, str] | None = None,
                 startup_timeout: float = 300):
        self.http_port, self.grpc_port, self.metrics_port = _pick_ports(http_port, grpc_port, metrics_port)
        self.model_repository = Path(model_repository)
        self.log_path = Path(log_path) if log_path else None
        self.log_verbose, self.extra_args = log_verbose, tuple(extra_args)
        self.env, self.startup_timeout = env, startup_timeout
        self.process: subprocess.Popen | None = None

    @property
    def http_url(self) -> str:
        return f"127.0.0.1:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_text(self) -> str:
        """Everything the server has written so far (stdout and stderr)."""
        if self.log_path is None or not self.log_path.is_file():
            return ""
        return self.log_path.read_text(errors="replace")

    def _get_ok(self, path: str, timeout: float = 2.0, base: str | None = None) -> bool:
        try:
            with urllib.request.urlopen(f"http://{base or self.http_url}{path}", timeout=timeout) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def is_ready(self) -> bool:
        """True when /v2/health/ready answers 200 (server up and all models loaded)."""
        return self._get_ok("/v2/health/ready")

    def _metrics_up(self) -> bool:
        """The metrics endpoint starts a little after HTTP reports ready: a scrape right after start()
        must not be refused. True at once when metrics are switched off."""
        if any(a.replace(" ", "") in ("--allow-metrics=false", "--allow-metrics=0") for a in self.extra_args):
            return True
        return self._get_ok("/metrics", base=f"127.0.0.1:{self.metrics_port}")

    def is_model_ready(self, name: str) -> bool:
        """True when model `name` is loaded and ready."""
        return self._get_ok(f"/v2/models/{name}/ready")

    def _failure(self, why: str) -> RuntimeError:
        tail = "\n".join(self.log_text().splitlines()[-60:])
        return RuntimeError(f"tritonserver {why} (log: {self.log_path}); last lines:\n{tail}")

    def start(self) -> "TritonServer":
        """Launch the server and wait until it is ready; raise with the log's tail if it is not.

        The log file (a temporary file unless `log_path` was given) is kept for post-mortems.
        """
        if self.process is not None:
            raise RuntimeError("server already started")
        check_numpy()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="tritonserver-", suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        backend_dir = assemble_backend_dir()
        cmd = build_command(self.model_repository, self.http_port, self.grpc_port, self.metrics_port,
                            backend_dir=backend_dir, log_verbose=self.log_verbose, extra_args=self.extra_args)
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, env=server_env(self.env))
        try:
            deadline = time.monotonic() + self.startup_timeout
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    raise self._failure(f"exited with code {self.process.returncode} during start-up")
                if self.is_ready() and self._metrics_up():
                    return self
                time.sleep(0.25)
            raise self._failure(f"was not ready after {self.startup_timeout:g} s")
        except BaseException:
            # __exit__ does not run when __enter__ raises (Ctrl-C included): never leave a server behind.
            self.stop()
            raise

    def stop(self, timeout: float = 60) -> int | None:
        """SIGTERM (the server unloads models, calling their finalize), wait, then SIGKILL.

        Returns the exit code, or None if the server was never started.
        """
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        return self.process.returncode

    def __enter__(self) -> "TritonServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: Sequence[str] | None = None) -> None:
    """`tritonllm-serve`: prepare the default model, then serve it on tritonserver, supervised (supervision/supervisor.py).

    Arguments it does not know (or everything after `--`) are passed on to tritonserver. With
    --no-supervise, tritonserver itself runs in the foreground on the public ports.
    """
    parser = argparse.ArgumentParser(prog="tritonllm-serve", description=main.__doc__.splitlines()[0])
    parser.add_argument("--model-repository", default=str(Path.cwd() / "model_repository"))
    parser.add_argument("--host", default="127.0.0.1", help="address all three endpoints bind to")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--log-verbose", type=int, default=0)
    parser.add_argument("--no-prepare", action="store_true",
                        help="skip converting the packaged default model before starting")
    parser.add_argument("--openai-port", type=int, default=None,
                        help="also serve the OpenAI-compatible API (tritonllm.openai) on --host at this port")
    _add_supervision_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]

    if not Path(args.model_repository).is_dir():
        parser.error(f"model repository {args.model_repository} is not a folder")
    try:
        check_numpy()
    except RuntimeError as exc:
        parser.exit(1, f"tritonllm-serve: {exc}\n")
    if not args.no_prepare:
        # Converting the GGUF takes tens of seconds once; doing it here keeps it out of the
        # server's model-load time. A failure is reported but need not stop the server.
        try:
            from tritonllm.models.model_files import resolve_model_dir
            print(f"default model ready in {resolve_model_dir('default')}", flush=True)
        except Exception as exc:  # noqa: BLE001 - any failure gets the same clear message
            print(f"tritonllm-serve: could not prepare the default model ({type(exc).__name__}: {exc}); "
                  "models that need it will fail to load. Use --no-prepare to skip this step.",
                  file=sys.stderr, flush=True)
    cmd = build_command(args.model_repository, args.http_port, args.grpc_port, args.metrics_port,
                        host=args.host, backend_dir=assemble_backend_dir(),
                        log_verbose=args.log_verbose, extra_args=extra)
    if args.no_supervise:
        print("running:", shlex.join(cmd), flush=True)
    print(f"gRPC: {args.host}:{args.grpc_port}   HTTP: {args.host}:{args.http_port}   "
          f"metrics: http://{args.host}:{args.metrics_port}/metrics", flush=True)
    print(f"try:  curl -s -X POST {args.host}:{args.http_port}/v2/models/smollm2/generate_stream "
          """-d '{"text_input": "What is the capital of France?", "stream": true, """
          """"sampling_parameters": "{\\"max_tokens\\": 32}"}'""", flush=True)
    if args.openai_port is not None:
        from tritonllm.openai.server import start_server

        # A child process that stops by itself once its parent is gone (tritonllm-serve; tritonserver after the
        # exec below with --no-supervise).
        grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        start_server(f"{grpc_host}:{args.grpc_port}", args.host, args.openai_port)
        print(f"OpenAI API: http://{args.host}:{args.openai_port}/v1", flush=True)
    if args.no_supervise:
        # exec, not a child: Ctrl-C and signals reach tritonserver directly and logs go to the terminal.
        os.execvpe(cmd[0], cmd, server_env())
    else:
        _run_supervised(args, extra)


def _add_supervision_arguments(parser: argparse.ArgumentParser) -> None:
    from tritonllm.serving.supervision import cli

    cli.add_arguments(parser)


def _run_supervised(args: argparse.Namespace, extra: list[str]) -> None:
    """tritonserver as a child on private ports, the front on the public ones, until SIGTERM/SIGINT."""
    from tritonllm.serving.supervision import cli

    sys.exit(cli.run(args, extra))


if __name__ == "__main__":
    main()
