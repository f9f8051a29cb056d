"""Kernel tests: without a GPU, Triton kernels run in the CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when ``@triton.jit`` runs. epd.kernels builds its
kernels lazily (per interpret mode), so the autouse fixture below is enough for them;
the module-level default also covers kernels that other modules jit at import time, as
long as they are imported after this conftest.

triton itself is imported here *before* ``TRITON_INTERPRET=1`` is set, as happens in a
full run when an earlier module imports it: triton's own ``@jit`` helpers (``tl.max``,
``tl.zeros_like``) are then compiled-mode functions the interpreter cannot call, so a
kernel that uses one fails here and not only in the full suite.
"""

import importlib.util
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

if importlib.util.find_spec("triton") is not None and "TRITON_INTERPRET" not in os.environ:
    import triton  # noqa: F401  (before TRITON_INTERPRET=1: see the docstring)

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
