"""A Triton stub process that has finished leaves without tearing down the Python interpreter.

tritonserver waits for a model's stub process to exit before it counts the model unloaded (and at
its own shutdown): the stub answers the finalize request, runs the model's `finalize()`, stops its
threads, and then returns from main, which finalizes the interpreter. With torch and a model
loaded, that last part (every module's teardown, then libtorch's static destructors) takes most of
a second, for nothing: the process's memory goes back to the system either way, the server has
already had every answer the stub owed it, and shared memory is the server's to remove. The same
holds for the short-lived stub that answers `auto_complete_config` at each load.

So, inside a stub only, the interpreter's exit is cut short: an `atexit` handler flushes the logs
and standard streams and ends the process with `os._exit(0)`, the code the stub's main returns.
Python runs `atexit` handlers last-registered first, so those registered after this one (while
the engine loads) have run by then. Of those registered before it, logging's flush is called
here; multiprocessing's (registered when torch imports it) only ends multiprocessing children,
and a stub starts none (tensor-parallel workers are subprocesses, stopped by `finalize()`). The
handler is installed nowhere else: in a test, a benchmark or a user's process it would hide the
exit status.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

STUB_EXECUTABLE = "triton_python_backend_stub"

_installed = False


def in_triton_stub() -> bool:
    """True inside a Python-backend stub process (the interpreter embedded in Triton's stub binary)."""
    try:
        return os.path.basename(os.readlink("/proc/self/exe")) == STUB_EXECUTABLE
    except OSError:  # no /proc: not a Linux stub
        return False


def _exit_now() -> None:
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os._exit(0)


def skip_interpreter_teardown() -> None:
    """In a Triton stub, end the process at interpreter exit without the teardown; elsewhere do nothing."""
    global _installed
    if not _installed and in_triton_stub():
        atexit.register(_exit_now)
        _installed = True
