"""The base types every other package of tritonllm shares: the engine's configuration and its
parameter parsing, per-request sampling parameters (a guided request as plain data), sequences,
outputs and request errors. It imports no other package of tritonllm."""
