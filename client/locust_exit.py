"""Leaving a Locust run once its stats are written, without the interpreter's finalizers.

Every Locust user closes its gRPC channel in `on_stop`, but tritonclient closes the channel again from
`__del__` when the interpreter tears down, and under grpc's gevent integration that close can block
forever (seen: `Channel._close` from `InferenceServerClient.__del__`, after the run's summary and CSVs
were done). atexit hooks run after Locust's `sys.exit` has closed its CSV files and before finalizers,
so exiting there keeps the exit code and loses nothing.
"""

from __future__ import annotations

import atexit
import os
import sys


def exit_before_finalizers(exit_code: int) -> None:
    """At interpreter exit: flush stdout and stderr, then leave with `exit_code` (Locust's quit event)."""
    def _exit():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream has nothing left to flush
                pass
        os._exit(exit_code)

    atexit.register(_exit)
