"""What a model instance does once its engine has died while its stub process lives on.

The engine thread stops after an exception in a step or when a tensor-parallel worker exits
(engine_loop.py); every request it held has had its error response by then, and new ones are refused
with UNAVAILABLE. Left at that, the model would stay READY for ever, refusing everything: tritonserver
2.51's Python backend gives a model no way to report itself not ready. So, as Triton's vLLM backend
does with an unhealthy engine, the model unloads itself (`pb_utils.unload_model`, which needs
`--model-control-mode=explicit`): readiness turns false, and whoever loaded it can load it again.

Under `tritonllm-serve` (supervision/supervisor.py) the reason is also written, as one small JSON
file, into the folder named by TRITONLLM_HEALTH_DIR: the supervisor sees it within a quarter of a
second, ends what is still in flight with that reason, and reloads the model.
"""

from __future__ import annotations

import json
import logging
import os
import threading

logger = logging.getLogger("tritonllm")

HEALTH_DIR_ENV = "TRITONLLM_HEALTH_DIR"


def write_report(model_name: str, instance_name: str, reason: str, folder: str | None = None) -> str | None:
    """The death report for the supervisor (atomically: write, then rename); its path, or None."""
    folder = folder if folder is not None else os.environ.get(HEALTH_DIR_ENV)
    if not folder:
        return None
    target = os.path.join(folder, model_name)
    try:
        os.makedirs(target, exist_ok=True)
        path = os.path.join(target, f"{instance_name}.{os.getpid()}.json")
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"model": model_name, "instance": instance_name, "pid": os.getpid(), "reason": reason}, f)
        os.replace(tmp, path)
        return path
    except OSError as exc:
        logger.warning("could not write the engine's death report into %s: %s", target, exc)
        return None


def report_engine_death(pb_utils, model_name: str, instance_name: str, reason: str) -> threading.Thread:
    """Report the death and unload the model, on a thread of its own.

    Not on the caller's thread: the unload makes tritonserver call this instance's finalize, which
    joins the threads that serve responses, the caller among them.
    """
    logger.error("model %s instance %s: the engine died (%s); unloading the model so that it reports not ready",
                 model_name, instance_name, reason)
    write_report(model_name, instance_name, reason)

    def unload() -> None:
        try:
            pb_utils.unload_model(model_name)
        except Exception as exc:  # noqa: BLE001 - e.g. not in explicit model control mode
            logger.error("model %s could not unload itself (%s): it stays loaded and answers UNAVAILABLE; "
                         "restart the server", model_name, exc)

    thread = threading.Thread(target=unload, name="tritonllm-self-unload", daemon=True)
    thread.start()
    return thread
