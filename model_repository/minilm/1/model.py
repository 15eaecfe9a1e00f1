"""all-MiniLM-L6-v2 embeddings served by the tritonllm embedding engine (token-budget batching)."""

from tritonllm.serving.embedding_model import TritonPythonModel  # noqa: F401  (the class Triton looks for)
