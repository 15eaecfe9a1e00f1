"""The supervisor's calls to tritonserver's private HTTP port: liveness, the repository index, load, unload.

Every call is bounded and answers instead of raising: a tritonserver that is down or hung is one of the
states the supervisor handles, not an error in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import aiohttp

LOAD_TIMEOUT_S = 1800.0  # a first load converts the packaged model and warms the engine up


class TritonserverApi:
    def __init__(self, session: aiohttp.ClientSession):
        self.session = session
        self.address = ""  # host:port of tritonserver's HTTP endpoint; changes when it is started again

    async def get_ok(self, path: str, timeout: float = 5) -> bool:
        try:
            async with self.session.get(f"http://{self.address}{path}",
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                await r.read()
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def post(self, path: str, timeout: float) -> tuple[int, str]:
        try:
            async with self.session.post(f"http://{self.address}{path}", data=b"{}",
                                         timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                return r.status, (await r.read()).decode(errors="replace")
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            return 0, f"{type(exc).__name__}: {exc}"

    async def load(self, model: str) -> str | None:
        """Load `model` (blocks until loaded or failed): None, or the error."""
        status, body = await self.post(f"/v2/repository/models/{model}/load", LOAD_TIMEOUT_S)
        if status == 200:
            return None
        with contextlib.suppress(ValueError, TypeError, AttributeError):
            body = json.loads(body).get("error", body)
        return body or f"HTTP {status}"

    async def unload(self, model: str, timeout: float = 30) -> tuple[int, str]:
        return await self.post(f"/v2/repository/models/{model}/unload", timeout)

    async def index(self) -> dict[str, dict] | None:
        """The repository index by model name, or None when tritonserver does not answer."""
        status, body = await self.post("/v2/repository/index", 10)
        if status != 200:
            return None
        with contextlib.suppress(ValueError):
            return {e["name"]: e for e in json.loads(body)}
        return None
