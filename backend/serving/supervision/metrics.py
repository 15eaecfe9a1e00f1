"""The metrics the front serves: tritonserver's, corrected where a dead stub left them wrong, plus the
supervisor's own families (docs/METRICS.md)."""

from __future__ import annotations

import re
from collections.abc import Callable

_ALIVE = re.compile(r'^(llm_engine_alive\{[^}]*model="(?P<model>[^"]*)"[^}]*\}) (?P<value>\S+)$')


def rewrite_metrics(text: str, serving: Callable[[str], bool]) -> str:
    """tritonserver's metrics, with `llm_engine_alive` 0 for every model that cannot serve now.

    The gauge lives in tritonserver's process but is set by the model's stub: a stub that died leaves
    it at its last value, 1.
    """
    lines = []
    for line in text.splitlines():
        match = _ALIVE.match(line)
        if match is not None and not serving(match["model"]):
            line = f"{match.group(1)} 0"
        lines.append(line)
    return "\n".join(lines) + ("\n" if lines else "")


def supervisor_metrics(supervisor) -> str:
    """The supervisor's families, in the text exposition format (`supervisor` is a Supervisor)."""
    lines = []

    def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{{{labels}}} {value:g}" if labels else f"{name} {value:g}" for labels, value in samples)

    models = sorted(supervisor.models.values(), key=lambda m: m.name)
    family("llm_model_ready", "gauge", "1 while the model serves, as tritonllm-serve's supervisor sees it",
           [(f'model="{m.name}"', 1.0 if supervisor.model_serving(m.name) and supervisor.phase == "serving" else 0.0)
            for m in models])
    family("llm_model_failed", "gauge", "1 once the supervisor has given up restarting the model",
           [(f'model="{m.name}"', 1.0 if m.state == "failed" else 0.0) for m in models])
    family("llm_model_restarts_total", "counter", "automatic reloads of the model after it died",
           [(f'model="{m.name}"', float(m.restarts_total)) for m in models])
    family("llm_model_deaths_total", "counter", "deaths of the model seen by the supervisor, by cause",
           [(f'model="{m.name}",cause="{c}"', float(m.deaths[c])) for m in models
            for c in ("stub_died", "engine_died", "unloaded_itself", "server_died")])
    ended = dict(supervisor.front.inflight.ended) if supervisor.front is not None else {}
    refused = dict(supervisor.front.refused) if supervisor.front is not None else {}
    samples = [(f'model="{model}",cause="{cause}"', float(n)) for (model, cause), n in sorted(ended.items())]
    samples += [(f'model="{model}",cause="refused"', float(n)) for model, n in sorted(refused.items())]
    family("llm_front_request_errors_total", "counter",
           "requests tritonllm-serve's front answered with an error itself, by cause", samples)
    family("llm_server_restarts_total", "counter", "tritonserver restarts after it died or hung",
           [("", float(supervisor.server_generation - 1 if supervisor.server_generation else 0))])
    return "\n".join(lines) + "\n"

