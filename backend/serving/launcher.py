"""`tritonllm-serve`: a real `tritonserver` with our Python-backend models, from PyPI's nvidia-pytriton
wheel, supervised (supervision/) or in the foreground. How tritonserver is found, given its backend
directory and environment, and started: tritonserver_process.py.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

# The supervisor forks to exec tritonserver (its preexec_fn sets the parent-death signal) while the
# front's gRPC threads run. gRPC's fork handlers are for children that go on using gRPC, which ours
# never do: with them on, a fork that met a busy gRPC thread left the front's poller with a closed
# descriptor and tritonserver aborted at start. Set before grpc is first imported (the front's modules).
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from tritonllm.serving.supervision import cli as supervision_cli  # noqa: E402
from tritonllm.serving.tritonserver_process import assemble_backend_dir, build_command, check_numpy, server_env  # noqa: E402


def openai_options(args: argparse.Namespace) -> list[str]:
    """The OpenAI server's own options among tritonllm-serve's, as its command line takes them."""
    return [*(["--chat-template", args.chat_template] if args.chat_template is not None else []),
            *(["--enable-auto-tool-choice"] if args.enable_auto_tool_choice else []),
            *(["--tool-call-parser", args.tool_call_parser] if args.tool_call_parser else []),
            *(["--reasoning-parser", args.reasoning_parser] if args.reasoning_parser else [])]


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
    parser.add_argument("--chat-template", default=None,
                        help="the OpenAI API's chat template: a file, a shipped one's name (chatml_hermes_tools) or its text")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='the OpenAI API serves tool_choice "auto" (with --tool-call-parser)')
    parser.add_argument("--tool-call-parser", default=None, help="how the models write tool calls: hermes or llama3_json")
    parser.add_argument("--reasoning-parser", default=None,
                        help="the OpenAI API gives a reasoning model's thinking apart: deepseek_r1 or qwen3")
    supervision_cli.add_arguments(parser)
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
    start_openai = None
    if args.openai_port is not None:
        from tritonllm.openai.child_process import start_server

        # A child process that stops by itself once its parent is gone (tritonllm-serve; tritonserver after the
        # exec below with --no-supervise).
        grpc_host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "") else args.host
        start_openai = partial(start_server, f"{grpc_host}:{args.grpc_port}", args.host, args.openai_port,
                               extra_args=openai_options(args), model_repository=str(Path(args.model_repository).resolve()))
        print(f"OpenAI API: http://{args.host}:{args.openai_port}/v1", flush=True)
    if args.no_supervise:
        if start_openai is not None:
            start_openai()
        # exec, not a child: Ctrl-C and signals reach tritonserver directly and logs go to the terminal.
        os.execvpe(cmd[0], cmd, server_env())
    else:
        # tritonserver as a child on private ports, the front on the public ones, until SIGTERM/SIGINT; the
        # OpenAI server beside them, started again if it dies.
        from tritonllm.serving.supervision.companion import Companion

        companions = [Companion("OpenAI server", start_openai)] if start_openai is not None else []
        sys.exit(supervision_cli.run(args, extra, companions))


if __name__ == "__main__":
    main()
