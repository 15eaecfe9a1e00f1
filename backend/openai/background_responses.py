"""Background responses (`POST /v1/responses` with `background: true`), as OpenAI's background mode.

The answer is generated in this server whatever the client does: the request is answered at once with
the response `queued` (or, with `stream: true`, with its events as they come, and a client that goes
away stops nothing). The response is kept in the ResponseStore from its start, so `GET
/v1/responses/{id}` shows it as it stands (`queued`, `in_progress`, then `completed`, `incomplete`,
`failed` or `cancelled`); `POST /v1/responses/{id}/cancel` stops it (its Triton requests are cancelled);
and one created streaming keeps its events, so that `GET /v1/responses/{id}?stream=true&starting_after=N`
sends those after sequence number N and then follows the rest as they come.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from tritonllm.openai.protocol import OpenAIError, bad_request
from tritonllm.openai.responses_api import ResponseOutput, ResponseStore

logger = logging.getLogger(__name__)

# The generation of one response: given where its events go, it feeds the output to its end.
Generate = Callable[[Callable[[list[dict]], None]], Awaitable[None]]
_RUNNING = ("queued", "in_progress")


class _Run:
    """One background response while it runs: its task, and a wake-up for those following its events."""

    def __init__(self, output: ResponseOutput, events: list[dict] | None, keep: Callable[[list[dict] | None], None]):
        self.output, self.events, self.keep = output, events, keep
        self.task: asyncio.Task | None = None
        self._more = asyncio.Event()

    def record(self, events: list[dict]) -> None:
        if self.events is not None and events:
            self.events.extend(events)
            self.wake()

    def wake(self) -> None:
        self._more.set()
        self._more = asyncio.Event()  # those woken wait on the next one

    async def more(self) -> None:
        await self._more.wait()


class BackgroundResponses:
    """The background responses that are running, over the store that keeps them all."""

    def __init__(self, store: ResponseStore):
        self.store = store
        self._runs: dict[str, _Run] = {}

    def start(self, output: ResponseOutput, streamed: bool, generate: Generate,
              keep: Callable[[list[dict] | None], None]) -> list[dict]:
        """Start `output`'s generation; returns its first events (`response.created`, whose response is
        the `queued` one to answer with). `keep(events)` puts the response in the store."""
        events: list[dict] | None = [] if streamed else None
        run = self._runs[output.id] = _Run(output, events, keep)
        first = output.start()
        run.record(first)
        keep(events)
        run.task = asyncio.ensure_future(self._run(run, generate))
        return first

    async def _run(self, run: _Run, generate: Generate) -> None:
        output = run.output
        try:
            await generate(run.record)
        except asyncio.CancelledError:
            run.record(output.cancelled())
        except Exception as exc:  # noqa: BLE001 - a failed background response is kept as failed, never lost
            if not isinstance(exc, OpenAIError):
                logger.exception("background response %s failed", output.id)
                exc = OpenAIError(500, f"{type(exc).__name__}: {exc}", "internal_error")
            run.record(output.failed(output.body.named(exc)))
        finally:
            self._end(run)

    def _end(self, run: _Run) -> None:
        if self._runs.pop(run.output.id, None) is None:
            return
        run.keep(run.events)  # again, whole: its size and its conversation as they end
        run.wake()

    async def _stop(self, runs: list[_Run]) -> None:
        for run in runs:
            run.task.cancel()
        await asyncio.gather(*(run.task for run in runs), return_exceptions=True)
        for run in runs:  # a task cancelled before it ran never reached its own ending
            if run.output.id in self._runs:
                run.record(run.output.cancelled())
                self._end(run)

    async def cancel(self, response_id: str) -> dict:
        """OpenAI's cancel: a running background response stops and is `cancelled`; cancelling it again
        gives it back as it is; a response that was not in the background, or has ended, is a 400."""
        response = self.store.get(response_id)
        if not response["background"]:
            raise bad_request("Cannot cancel a synchronous response.", "response_id")
        run = self._runs.get(response_id)
        if run is not None:
            await self._stop([run])
        elif response["status"] not in ("cancelled", *_RUNNING):
            raise bad_request(f"Cannot cancel a response that is already {response['status']}.", "response_id")
        return self.store.get(response_id)  # as it ended

    async def follow(self, response_id: str, starting_after: int | None) -> AsyncIterator[dict]:
        """The events of a background response created streaming after sequence number `starting_after`
        (all of them without it), then each new one until it ends."""
        events = self.store.events(response_id)
        if starting_after is not None and starting_after < -1:
            raise bad_request(f"starting_after must be a sequence number, at least -1; got {starting_after}",
                              "starting_after")
        return self._follow(response_id, events, 0 if starting_after is None else starting_after + 1)

    async def _follow(self, response_id: str, events: list[dict], at: int) -> AsyncIterator[dict]:
        while True:
            while at < len(events):
                yield events[at]
                at += 1
            run = self._runs.get(response_id)
            if run is None:  # ended: every event is in the list
                return
            await run.more()

    async def close(self) -> None:
        """At shutdown: every running response is cancelled (and kept as such until the process ends)."""
        await self._stop(list(self._runs.values()))
