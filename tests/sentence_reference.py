"""The embedding tests' reference: sentence-transformers' own `encode` of the default embedding model
(all-MiniLM-L6-v2), and how close our vectors must be to its."""

from __future__ import annotations

import numpy as np
import pytest

MAX_COSINE_DISTANCE = 1e-5


def load_sentence_transformer():
    """sentence-transformers' model of the folder our embedding engine serves (the test extra installs
    the package; without it the test is skipped)."""
    sentence_transformers = pytest.importorskip("sentence_transformers")
    from tritonllm.embeddings.config import resolve_embedding_model_dir

    return sentence_transformers.SentenceTransformer(str(resolve_embedding_model_dir("default")), device="cpu")


def assert_close(ours: np.ndarray, ref: np.ndarray, normalized: bool = True) -> None:
    """Float32 vectors of `ref`'s shape, each within MAX_COSINE_DISTANCE of its reference (and of length 1
    where `normalized`)."""
    assert ours.shape == ref.shape and ours.dtype == np.float32
    if normalized:
        np.testing.assert_allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    assert (1 - cos).max() < MAX_COSINE_DISTANCE, 1 - cos
