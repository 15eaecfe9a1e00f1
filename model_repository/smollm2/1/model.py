"""SmolLM2 served by the tritonllm engine (continuous batching, paged KV cache, fused greedy head)."""

from tritonllm.serving.generate_model import TritonPythonModel  # noqa: F401  (the class Triton looks for)
