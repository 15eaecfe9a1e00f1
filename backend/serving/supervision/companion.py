"""A process the launcher runs beside tritonserver (the OpenAI server), started again whenever it dies.

It talks to the front's public ports, so tritonserver's own restarts never touch it; what it needs is a
watch of its own: a server whose process died (an OOM kill, a crash) would otherwise leave its port
dead for good while everything else serves on.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import time
from collections.abc import Callable

from tritonllm.serving.supervision.processes import returncode_description

logger = logging.getLogger(__name__)

STOP_S = 10.0  # on the launcher's stop: SIGTERM, then SIGKILL after this long


class Companion:
    """Runs `start()`'s process until `stop()`, starting it again after each death: at once the first time,
    then after a back-off that doubles (1 s up to `backoff_max_s`) while it keeps dying within a minute."""

    def __init__(self, name: str, start: Callable[[], subprocess.Popen], backoff_max_s: float = 30.0):
        self.name, self._start, self.backoff_max_s = name, start, backoff_max_s
        self.process: subprocess.Popen | None = None
        self.restarts = 0
        self._stopping = False
        self._task: asyncio.Task | None = None

    def run(self) -> None:
        """Start it and watch it (on the running event loop)."""
        self.process = self._start()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        quick_deaths, started = 0, time.monotonic()  # deaths in a row, each within a minute of its start
        while True:
            while self.process.poll() is None:
                await asyncio.sleep(0.5)
            if self._stopping:
                return
            lived = time.monotonic() - started
            quick_deaths = 0 if lived > 60 else quick_deaths + 1
            backoff = self.backoff(quick_deaths)
            logger.error("the %s (pid %d) %s after %.0f s; starting it again%s", self.name, self.process.pid,
                         returncode_description(self.process.returncode), lived,
                         f" in {backoff:.0f} s" if backoff else "")
            await asyncio.sleep(backoff)
            if self._stopping:
                return
            self.process, started = self._start(), time.monotonic()
            self.restarts += 1

    def backoff(self, quick_deaths: int) -> float:
        """Seconds to wait before the next start, after `quick_deaths` deaths in a row within a minute of
        their starts (0: it had run longer)."""
        return 0.0 if quick_deaths <= 1 else min(2.0 ** (quick_deaths - 2), self.backoff_max_s)

    async def stop(self) -> None:
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.terminate()
        deadline = time.monotonic() + STOP_S
        while process.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        if process.poll() is None:
            process.kill()
            await asyncio.to_thread(process.wait)
