"""`tritonllm-serve`'s supervision options, and running the supervisor from the command line."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from tritonllm.serving.supervision.restart_policy import RestartPolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("supervision (tritonllm-serve runs tritonserver as its child, behind a front)")
    group.add_argument("--no-supervise", action="store_true",
                       help="exec tritonserver directly on the public ports: no front, no health watch, no restarts")
    group.add_argument("--max-restarts", type=int, default=RestartPolicy.max_restarts,
                       help="automatic restarts of a model within --restart-window before it is marked failed")
    group.add_argument("--restart-window", type=float, default=RestartPolicy.window_s, metavar="SECONDS")
    group.add_argument("--restart-backoff", type=float, default=RestartPolicy.backoff_initial_s, metavar="SECONDS",
                       help="wait before a model's first restart; doubles with each restart in the window, up to "
                            "--restart-backoff-max")
    group.add_argument("--restart-backoff-max", type=float, default=RestartPolicy.backoff_max_s, metavar="SECONDS",
                       help="the longest wait before a restart, however many came before it in the window")


def split_server_args(extra: list[str]) -> tuple[list[str], list[str] | None, float, str | None]:
    """(tritonserver's own arguments, models to load or None for all, exit timeout, a refusal or None).

    `--load-model` and `--exit-timeout-secs` are the launcher's to act on; another model control mode
    cannot be supervised.
    """
    rest, models, exit_timeout = [], [], 30.0
    it = iter(extra)
    for arg in it:
        key, eq, value = arg.partition("=")
        if key in ("--load-model", "--exit-timeout-secs", "--model-control-mode") and not eq:
            value = next(it, "")
        if key == "--load-model":
            models.append(value)
        elif key == "--exit-timeout-secs":
            exit_timeout = float(value)
        elif key == "--model-control-mode":
            if value != "explicit":
                return [], None, exit_timeout, (f"--model-control-mode={value} cannot be supervised (models are "
                                                "loaded and reloaded through the repository API); use --no-supervise")
        else:
            rest.append(arg)
    return rest, (models or None), exit_timeout, None


def run(args: argparse.Namespace, extra: list[str], companions: list | None = None) -> int:
    """Serve under supervision until a signal; the exit code. `companions`: supervision.companion.Companion
    processes to run beside tritonserver (the OpenAI server)."""
    try:
        import aiohttp  # noqa: F401
        import grpc  # noqa: F401
        from tritonclient.grpc import service_pb2  # noqa: F401
    except ImportError as exc:
        print(f"tritonllm-serve: the front needs tritonclient[grpc,http] ({exc}): pip install 'tritonclient[grpc,http]', "
              "or run with --no-supervise", flush=True)
        return 1
    server_args, models, exit_timeout, refusal = split_server_args(extra)
    if refusal is not None:
        print(f"tritonllm-serve: {refusal}", flush=True)
        return 2
    from tritonllm.serving.supervision.supervisor import Supervisor  # needs what was checked above

    logging.basicConfig(level=logging.INFO, format="%(asctime)s tritonllm-serve %(levelname)s: %(message)s")
    metrics_port = None if any(a.replace(" ", "") in ("--allow-metrics=false", "--allow-metrics=0") for a in server_args) \
        else args.metrics_port
    policy = RestartPolicy(max_restarts=args.max_restarts, window_s=args.restart_window,
                           backoff_initial_s=args.restart_backoff, backoff_max_s=args.restart_backoff_max)
    supervisor = Supervisor(Path(args.model_repository), args.host, args.http_port, args.grpc_port, metrics_port,
                            server_args, models, policy, exit_timeout, args.log_verbose, companions or [])
    return asyncio.run(supervisor.run())
