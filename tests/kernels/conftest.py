"""Kernel tests: without a GPU, Triton kernels run in the CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs. epd.kernels builds its
kernels lazily (per interpret mode), so the autouse fixture below is enough for them;
the module-level default also covers kernels that other modules jit at import time, as
long as they are imported after this conftest.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _triton_interpret_without_gpu(monkeypatch):
    if not HAS_CUDA:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield


@pytest.fixture
def device() -> str:
    """Where Triton kernels run: the GPU when present, else CPU under the interpreter."""
    return "cuda" if HAS_CUDA else "cpu"
