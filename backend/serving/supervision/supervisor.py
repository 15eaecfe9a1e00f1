"""`tritonllm-serve`'s supervision: tritonserver as a child on private ports, its models watched and healed.

The launcher starts tritonserver with `--model-control-mode=explicit` on loopback ports of its own,
loads the repository's models itself through the repository API, and puts the front (front.py) on the
public ports. From then on it watches, from outside the processes that can die:

- **a model's stub process**: each stub (Triton's per-instance Python process, which holds the engine)
  is watched through a pidfd, so its exit is seen at once, whatever killed it (an OOM kill, a segfault,
  `kill -9`). tritonserver itself reports such a model READY for ever and never ends the requests that
  were in it (front.py says why), so the front ends them, each with an error naming the death;
- **an engine that died inside a living stub** (an exception in a step, a tensor-parallel worker gone):
  the model fails its own requests and unloads itself (generate_model.py, engine_health.py), and writes
  the reason into a folder the supervisor watches (TRITONLLM_HEALTH_DIR); a model found unloaded
  without an operator asking is treated the same way (the repository index, polled every second);
- **tritonserver itself**: its exit, or its HTTP endpoint not answering for a minute.

A dead model is unloaded at once (readiness turns false) and loaded again through the repository API
after a back-off (1 s, doubling up to a minute), the other models untouched. A model that needs more
than `max_restarts` restarts within `restart_window_s` is marked failed with its last reason and left
unloaded; an operator's load through the repository API starts it afresh. A tritonserver that died is
started again the same way, every model with it.

SIGTERM or SIGINT drains: the front refuses new requests and reports not ready, the requests in flight
get up to `--exit-timeout-secs` to finish and are then ended with an error, tritonserver is stopped
(killed if it does not exit, as it cannot while a dead stub's requests are open), and the launcher
exits 0. A second signal skips the wait.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp

from tritonllm.serving import tritonserver_process
from tritonllm.serving.engine_health import HEALTH_DIR_ENV
from tritonllm.serving.supervision.companion import Companion
from tritonllm.serving.supervision.front import Front, Policy
from tritonllm.serving.supervision.metrics import supervisor_metrics
from tritonllm.serving.supervision.model_state import Model
from tritonllm.serving.supervision.processes import (LIBC, ProcessWatch, any_stub_alive, children_of, exit_description,
                                                    kill_if_same, open_connections, set_parent_death_signal,
                                                    stubs_of)
from tritonllm.serving.supervision.restart_policy import RestartPolicy
from tritonllm.serving.supervision.tritonserver_api import TritonserverApi

logger = logging.getLogger("tritonllm.supervisor")

INDEX_POLL_S = 1.0
HEALTH_POLL_S = 0.25
HUNG_AFTER_S = 60.0  # tritonserver's HTTP endpoint silent this long: killed and started again
SERVER_STOP_S = 10.0  # after the drain, tritonserver gets this long to exit before it is killed


# ---- the supervisor ----------------------------------------------------------------------------------
class Supervisor:
    def __init__(self, model_repository: Path, host: str, http_port: int, grpc_port: int, metrics_port: int | None,
                 server_args: list[str], models: list[str] | None, policy: RestartPolicy, exit_timeout_s: float,
                 log_verbose: int = 0, companions: list[Companion] = ()):
        self.repository = model_repository.resolve()
        self.host, self.http_port, self.grpc_port, self.metrics_port = host, http_port, grpc_port, metrics_port
        self.server_args, self.wanted, self.policy = server_args, models, policy
        self.exit_timeout_s, self.log_verbose = exit_timeout_s, log_verbose
        self.models: dict[str, Model] = {}
        self.process: subprocess.Popen | None = None
        self.phase = "starting"  # starting | serving | draining | stopped
        self.server_restarts: collections.deque = collections.deque()
        self._server_watch: ProcessWatch | None = None
        self._stub_watches: dict[int, ProcessWatch] = {}
        self.server_generation = 0
        # Versions whose stub died in this tritonserver: they never finish unloading, so its shutdown would
        # wait out its exit timeout on them once everything else has unloaded.
        self.dead_stub_versions = 0
        self._stop = asyncio.Event()
        self._signals = 0
        self._health_dir = Path(tempfile.mkdtemp(prefix="tritonllm-health-"))
        self._tasks: set[asyncio.Task] = set()
        self.front = None
        self._session = None
        self.api: TritonserverApi | None = None
        self.companions = list(companions)  # processes beside tritonserver (the OpenAI server), kept running

    # -- the front's questions
    def refusal(self, model: str) -> str | None:
        if self.phase == "starting" and (self.wanted is None or model in self.wanted):
            return f"model '{model}' is unavailable: the server is starting (loading models); retry later"
        m = self.models.get(model)
        if m is None or m.state in ("ready", "unloaded"):
            return None
        return m.reason or f"model '{model}' is unavailable ({m.state}); retry later"

    def model_serving(self, model: str) -> bool:
        return self.refusal(model) is None

    def server_ready(self) -> bool:
        return self.phase == "serving" and all(m.state in ("ready", "unloaded") for m in self.models.values())

    def not_ready_reason(self) -> str:
        if self.phase != "serving":
            return f"the server is {self.phase}"
        return "; ".join(m.reason or f"{m.name}: {m.state}" for m in self.models.values()
                         if m.state not in ("ready", "unloaded")) or "not ready"

    def on_repository(self, model: str, load: bool, ok: bool | None) -> None:
        """An operator's load or unload through the front (ok None: about to be forwarded)."""
        m = self.models.setdefault(model, Model(model, state="unloaded"))
        if m.task is not None and not m.task.done():
            m.task.cancel()  # the operator decides now
        if ok is None:
            self._unwatch(m)
            m.state, m.reason = ("loading", f"model '{model}' is unavailable: being loaded by an operator") if load \
                else ("unloaded", "")
            return
        if load and ok:
            m.serves()
            m.restarts.clear()
            self._watch_stubs(m)
            logger.info("model %s loaded by an operator through the repository API", model)
        elif load:
            m.state, m.reason = "failed", f"model '{model}' is unavailable: an operator's load failed"
        else:
            m.state, m.reason = "unloaded", ""
            logger.info("model %s unloaded by an operator through the repository API; not restarted", model)

    def metrics_text(self) -> str:
        return supervisor_metrics(self)

    # -- tritonserver
    def _server_command(self) -> tuple[list[str], dict]:
        self.private = dict(zip(("http", "grpc", "metrics"), tritonserver_process.pick_ports(None, None, None)))
        args = [*self.server_args, "--model-control-mode=explicit", "--strict-readiness=true",
                # After the front's drain nothing is left in flight but what a dead stub holds: no point waiting.
                f"--exit-timeout-secs={int(SERVER_STOP_S // 2)}"]
        cmd = tritonserver_process.build_command(self.repository, self.private["http"], self.private["grpc"],
                                                 self.private["metrics"], host="127.0.0.1",
                                                 backend_dir=tritonserver_process.assemble_backend_dir(),
                                                 log_verbose=self.log_verbose, extra_args=args)
        env = tritonserver_process.server_env()
        env[HEALTH_DIR_ENV] = str(self._health_dir)
        return cmd, env

    async def _start_server(self) -> None:
        cmd, env = self._server_command()
        self.server_generation += 1
        generation = self.server_generation
        self.dead_stub_versions = 0
        logger.info("starting tritonserver on private ports (HTTP %d, gRPC %d, metrics %d)", self.private["http"],
                    self.private["grpc"], self.private["metrics"])
        # Its own session: Ctrl-C on the terminal reaches the launcher, which drains, not tritonserver.
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=set_parent_death_signal if LIBC is not None else None)
        self.front.upstream_http = f"127.0.0.1:{self.private['http']}"
        self.api.address = self.front.upstream_http
        self.front.upstream_grpc = f"127.0.0.1:{self.private['grpc']}"
        self.front.upstream_metrics = f"127.0.0.1:{self.private['metrics']}"
        await self.front.reconnect()
        loop = asyncio.get_running_loop()
        self._server_watch = ProcessWatch(loop, self.process.pid, lambda: self._spawn(self._server_exited(generation)))
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tritonserver exited with code {self.process.returncode} while starting")
            if await self.api.get_ok("/v2/health/live"):
                return
            await asyncio.sleep(0.25)
        raise RuntimeError("tritonserver did not answer on its HTTP port within 300 s")

    async def _stop_server(self, timeout_s: float = SERVER_STOP_S) -> None:
        proc = self.process
        if proc is None:
            return
        if self._server_watch is not None:
            self._server_watch.cancel()
        # Its children, each seen while it is still theirs (once tritonserver is gone they are re-parented):
        # the stubs of the models that serve, of earlier loads still finishing, and of a load in flight that
        # nothing here has watched yet, one maybe still between fork and exec.
        children = {pid: None for m in self.models.values() for pid in (*m.stubs, *m.retired)}
        children.update(children_of(proc.pid))
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout_s
            while proc.poll() is None and time.monotonic() < deadline:
                children.update(children_of(proc.pid))
                if self.dead_stub_versions and not any_stub_alive(proc.pid):
                    # Every living model has unloaded (its stubs have exited); what is left is a dead stub's
                    # version, which tritonserver would wait on until its exit timeout, for nothing.
                    logger.info("every stub has ended; tritonserver waits only on the version(s) whose stub "
                                "died: stopping it now")
                    children.update(children_of(proc.pid))
                    proc.kill()
                    await asyncio.get_running_loop().run_in_executor(None, proc.wait)
                    break
                await asyncio.sleep(0.1)
            if proc.poll() is None:
                logger.warning("tritonserver did not exit within %.0f s of SIGTERM (requests held by a dead stub "
                               "keep it waiting): killing it", timeout_s)
                children.update(children_of(proc.pid))
                proc.kill()
                await asyncio.get_running_loop().run_in_executor(None, proc.wait)
        for pid, started in children.items():  # a killed tritonserver leaves its stubs behind
            kill_if_same(pid, started)
        for watch in self._stub_watches.values():
            watch.cancel()
        self._stub_watches.clear()

    async def _unload_models(self, timeout_s: float) -> None:
        """Before tritonserver's SIGTERM: unload the models that serve, through its API, and wait (bounded)
        until they have unloaded. After a SIGTERM tritonserver polls its loaded models once a second, so
        a stop that left the unload to it took up to a second longer; with nothing loaded it exits at once.
        What has not unloaded within `timeout_s` is left to the SIGTERM (and the kill after it)."""
        proc = self.process
        names = [m.name for m in self.models.values() if m.state == "ready"]
        if proc is None or proc.poll() is not None or self.api is None or not names:
            return

        async def unload_all() -> None:
            await asyncio.gather(*(self.api.unload(name, timeout_s) for name in names))
            while proc.poll() is None:
                index = await self.api.index()
                if index is not None and all(index.get(name, {}).get("state") not in ("READY", "UNLOADING")
                                             for name in names):
                    return
                await asyncio.sleep(0.05)

        logger.info("unloading %s", ", ".join(names))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(unload_all(), timeout_s)

    async def _server_exited(self, generation: int) -> None:
        if generation != self.server_generation or self.phase in ("draining", "stopped"):
            return
        code = await asyncio.get_running_loop().run_in_executor(None, self.process.wait)
        how = f"exited with code {code}" if code >= 0 else f"was killed by {signal.Signals(-code).name}"
        await self._server_failed(f"tritonserver {how}")

    async def _server_failed(self, why: str) -> None:
        logger.error("%s; every model's requests in flight end with an error", why)
        for m in self.models.values():
            if m.task is not None and not m.task.done():
                m.task.cancel()
            if m.state in ("ready", "loading", "dead"):
                m.deaths["server_died"] += 1
                m.state, m.reason = "dead", f"model '{m.name}' is unavailable: {why}; the server is being restarted"
            self._unwatch(m)
        self.front.fail_all(f"{why}; the request was lost; retry", "server_died")
        self.policy.prune(self.server_restarts)
        if len(self.server_restarts) >= self.policy.max_restarts:
            logger.error("tritonserver needed %d restarts within %.0f s: giving up", len(self.server_restarts),
                         self.policy.window_s)
            self.exit_code = 1
            self._stop.set()
            return
        await self._stop_server(timeout_s=5)
        delay = self.policy.backoff(len(self.server_restarts))
        logger.info("restarting tritonserver in %.0f s", delay)
        await asyncio.sleep(delay)
        self.server_restarts.append(time.monotonic())
        try:
            await self._start_server()
        except Exception as exc:  # noqa: BLE001 - counted as another death, with back-off
            await self._server_failed(f"tritonserver could not start again ({exc})")
            return
        for m in self.models.values():
            if m.state == "dead":
                m.zombie = False
                self._spawn_reload(m, "the server restarted")

    # -- watching models
    def _watch_stubs(self, m: Model) -> None:
        if self.process is None:
            return
        m.retired = {pid for pid in m.retired if os.path.exists(f"/proc/{pid}")}
        m.stubs = {pid: instance for pid, instance in stubs_of(self.process.pid, self.repository, m.name).items()
                   if pid not in m.retired}
        loop = asyncio.get_running_loop()
        for pid, instance in m.stubs.items():
            if pid not in self._stub_watches:
                self._stub_watches[pid] = ProcessWatch(loop, pid, lambda pid=pid, instance=instance, name=m.name:
                                                 self._stub_exited(name, pid, instance))
        if not m.stubs:
            logger.warning("model %s: no stub process found to watch; only the repository index tells its death", m.name)

    def _unwatch(self, m: Model) -> None:
        for pid in m.stubs:
            watch = self._stub_watches.pop(pid, None)
            if watch is not None:
                watch.cancel()

    def _stub_exited(self, model: str, pid: int, instance: str) -> None:
        self._stub_watches.pop(pid, None)
        m = self.models.get(model)
        if m is None or pid not in m.stubs or m.state != "ready" or self.phase != "serving":
            return  # an unload we asked for, or the server going away
        how = exit_description(pid)
        detail = f"its stub process (pid {pid}, instance {instance}) died, {how}"
        m.zombie = True
        self.dead_stub_versions += 1
        self._model_died(m, "stub_died", detail)

    def _model_died(self, m: Model, cause: str, detail: str) -> None:
        m.deaths[cause] += 1
        m.state, m.died_at = "dead", time.monotonic()
        m.reason = f"model '{m.name}' is unavailable: {detail}; it is being reloaded"
        ended = self.front.fail_model(m.name, f"model '{m.name}' is unavailable: {detail}; the request was lost "
                                              "in it. The model is being reloaded; retry.", "model_died")
        logger.error("model %s: %s; %d request(s) in flight ended with an error; readiness is false until it "
                     "is back", m.name, detail, ended)
        self._spawn_reload(m, detail)

    def _spawn_reload(self, m: Model, cause: str) -> None:
        if m.task is not None and not m.task.done():
            return
        m.task = self._spawn(self._reload(m, cause))

    async def _reload(self, m: Model, cause: str) -> None:
        # Unloaded at once: tritonserver's own readiness turns false too, and its other stubs stop.
        await self.api.unload(m.name, 30)
        if m.zombie:
            # That version never finishes unloading (its dead stub holds requests): its living stubs
            # would keep their weights and KV pools for good, so they go now. Their requests ended above.
            for pid in list(m.stubs):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        self._unwatch(m)
        m.retired.update(m.stubs)
        m.stubs = {}
        while True:
            self.policy.prune(m.restarts)
            if len(m.restarts) >= self.policy.max_restarts:
                m.state = "failed"
                m.reason = (f"model '{m.name}' has failed and is not restarted again: {len(m.restarts)} restarts "
                            f"within {self.policy.window_s:.0f} s, the last after: {cause}. Load it through the "
                            "repository API to try again")
                logger.error("%s", m.reason)
                return
            delay = self.policy.backoff(len(m.restarts))
            await asyncio.sleep(delay)
            if not m.zombie:
                # Its finalize frees the old engine's memory first; bounded, as tritonserver also waits
                # for the streams that carried requests to it.
                await self._wait_unloaded(m.name, 30)
            for stale in (self._health_dir / m.name).glob("*.json"):  # the dead load's, not the next one's
                stale.unlink(missing_ok=True)
            m.restarts.append(time.monotonic())
            m.restarts_total += 1
            attempt = len(m.restarts)
            m.state = "loading"
            m.reason = (f"model '{m.name}' is unavailable: reloading after {cause} (restart {attempt} of at most "
                        f"{self.policy.max_restarts} in {self.policy.window_s:.0f} s); retry later")
            logger.warning("model %s: restart %d (of at most %d within %.0f s) after a %.1f s back-off, because "
                           "%s", m.name, attempt, self.policy.max_restarts, self.policy.window_s, delay, cause)
            started = time.monotonic()
            error = await self.api.load(m.name)
            if error is None:
                m.serves()
                self._watch_stubs(m)
                since = time.monotonic() - m.died_at if m.died_at else 0.0
                logger.info("model %s serves again: loaded in %.1f s, %.1f s after it died", m.name,
                            time.monotonic() - started, since)
                return
            logger.error("model %s: reload failed: %s", m.name, error)
            cause = f"a failed reload ({error})"

    async def _wait_unloaded(self, model: str, timeout_s: float) -> None:
        """Until tritonserver has finished unloading `model` (its finalize ran), bounded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            index = await self.api.index()
            if index is not None and index.get(model, {}).get("state") != "UNLOADING":
                return
            await asyncio.sleep(0.5)

    async def _poll_index(self) -> None:
        """Models that left READY without anyone asking (they unloaded themselves); tritonserver hung."""
        silent_since = None
        while True:
            await asyncio.sleep(INDEX_POLL_S)
            if self.phase != "serving" or self.process is None or self.process.poll() is not None:
                silent_since = None
                continue
            generation, asked = self.server_generation, time.monotonic()
            index = await self.api.index()
            if generation != self.server_generation:
                continue
            if index is None:
                silent_since = silent_since or time.monotonic()
                if time.monotonic() - silent_since > HUNG_AFTER_S:
                    silent_since = None
                    with contextlib.suppress(ProcessLookupError):
                        self.process.kill()  # its exit is seen by the watch, which restarts it
                    logger.error("tritonserver has not answered for %.0f s: killed", HUNG_AFTER_S)
                continue
            silent_since = None
            for m in list(self.models.values()):
                state = index.get(m.name, {}).get("state")
                # An index asked for while it was (re)loading may come back after the load: not a death. Nor is
                # one answer alone: an engine that dies reports it at once (_poll_health); this is the fallback,
                # and it waits for a second poll to say the same.
                if m.state != "ready" or state == "READY" or m.ready_at >= asked:
                    m.unready_polls = 0
                    continue
                m.unready_polls += 1
                if m.unready_polls >= 2:
                    m.unready_polls = 0
                    reason = self._health_reason(m.name) or f"the engine stopped; tritonserver's index: {state}"
                    self._model_died(m, "unloaded_itself", f"it unloaded itself ({reason})")

    def _health_reason(self, model: str) -> str | None:
        for path in sorted((self._health_dir / model).glob("*.json")):
            with contextlib.suppress(OSError, ValueError):
                report = json.loads(path.read_text())
                path.unlink()
                return f"instance {report.get('instance')}, pid {report.get('pid')}: {report.get('reason')}"
        return None

    async def _poll_health(self) -> None:
        """Engine deaths the models report (engine_health.py): handled before they finish unloading."""
        while True:
            await asyncio.sleep(HEALTH_POLL_S)
            if self.phase != "serving":
                continue
            for m in list(self.models.values()):
                if m.state == "ready" and any((self._health_dir / m.name).glob("*.json")):
                    reason = self._health_reason(m.name)
                    self._model_died(m, "engine_died", f"its engine died ({reason})")

    # -- life
    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("supervisor task failed", exc_info=task.exception())

    def _on_signal(self, signum: int) -> None:
        self._signals += 1
        if self._signals == 1:
            logger.info("%s: draining (new requests refused; up to %.0f s for those in flight; signal again to "
                        "stop at once)", signal.Signals(signum).name, self.exit_timeout_s)
            self._stop.set()
        else:
            logger.warning("%s again: ending the requests in flight now", signal.Signals(signum).name)
            if self.front is not None:
                self.front.inflight.changed.set()

    async def run(self) -> int:
        self.exit_code = 0
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, self._on_signal, signum)
        self._session = aiohttp.ClientSession()
        self.api = TritonserverApi(self._session)
        policy = Policy(refusal=self.refusal, server_ready=self.server_ready, model_serving=self.model_serving,
                        on_repository=self.on_repository, not_ready_reason=self.not_ready_reason,
                        extra_metrics=self.metrics_text)
        self.front = Front(None, None, None, policy, self.host, self.http_port, self.grpc_port, self.metrics_port)
        try:
            for companion in self.companions:
                companion.run()
            await self.front.start()
            logger.info("front listening on %s: HTTP %d, gRPC %d, metrics %s", self.host, self.http_port,
                        self.grpc_port, self.metrics_port)
            await self._start_server()
            if not await self._load_all():
                self.exit_code = 1
                return 1
            self.phase = "serving"
            logger.info("serving: %s", ", ".join(sorted(self.models)))
            self._spawn(self._poll_index())
            self._spawn(self._poll_health())
            await self._stop.wait()
            if self.exit_code == 0:
                await self._drain()
            return self.exit_code
        except Exception as exc:  # noqa: BLE001 - a start that cannot go on: one clear line, exit 1
            logger.error("%s", exc)
            return 1
        finally:
            self.phase = "stopped"
            for task in list(self._tasks):
                task.cancel()
            # The front first: tritonserver waits (up to its exit timeout) for open HTTP connections,
            # the front's own keep-alive ones to it included, before it unloads anything.
            if self.front is not None:
                await self.front.stop()
            for companion in self.companions:
                await companion.stop()
            started = time.monotonic()
            await self._unload_models(SERVER_STOP_S / 2)
            await self._session.close()
            # On SIGTERM tritonserver first waits for its open HTTP connections, checking once a second: it is
            # sent once it has seen the ones just closed (all were ours), bounded.
            deadline = time.monotonic() + 1.0
            while (self.process is not None and self.process.poll() is None and open_connections(self.private["http"])
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.02)
            await self._stop_server(timeout_s=SERVER_STOP_S - (time.monotonic() - started))
            shutil.rmtree(self._health_dir, ignore_errors=True)

    async def _load_all(self) -> bool:
        names = self.wanted
        if names is None:
            index = await self.api.index() or {}
            names = sorted(index)
        for name in names:
            self.models[name] = Model(name, reason=f"model '{name}' is unavailable: loading; retry later")
        logger.info("loading %s", ", ".join(names) or "no models")
        errors = await asyncio.gather(*(self.api.load(n) for n in names))
        failed = [(n, e) for n, e in zip(names, errors) if e is not None]
        for name, error in failed:
            logger.error("model %s failed to load: %s", name, error)
        if failed:
            return False
        for name in names:
            m = self.models[name]
            m.serves()
            self._watch_stubs(m)
        return True

    async def _drain(self) -> None:
        self.phase = "draining"
        self.front.draining = True
        inflight = self.front.inflight
        logger.info("draining: %d request(s) in flight", inflight.count())
        deadline = time.monotonic() + self.exit_timeout_s
        while inflight.count() and self._signals < 2 and time.monotonic() < deadline:
            inflight.changed.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(inflight.changed.wait(), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
        left = self.front.fail_all(f"the server is shutting down: the request did not finish within the exit timeout "
                                   f"({self.exit_timeout_s:g} s); retry on another replica", "shutdown")
        logger.info("drained%s; stopping tritonserver", f": {left} request(s) ended with an error" if left else "")


