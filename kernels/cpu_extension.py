"""epd's CPU kernels (``csrc/*.cpp``), one C++ extension built on first use.

It holds the paged decode attention kernel (``paged_decode_cpu.cpp``), the linear layers at
the memory bound for a decode step's few rows (``linear_cpu.cpp``: bf16 with AVX512-BF16,
fp32, int8 weight-only), the element-wise ops of a decoder layer (``elementwise_cpu.cpp``)
and the fused decode step that chains them (``decode_layers_cpu.cpp``, ``FusedDecoder``).
It is compiled once per machine with ``torch.utils.cpp_extension.load`` (g++ and ninja,
``-march=native``; ``make install`` builds it) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``); processes that start
while it builds wait on the build's lock file. Where it cannot be built, :func:`load`
returns None once, with a warning, and every caller uses its torch reference.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp", "paged_decode_cpu.cpp", "linear_cpu.cpp", "elementwise_cpu.cpp", "decode_layers_cpu.cpp")
_LOCK = threading.Lock()
_EXT = None
_TRIED = False


def load():
    """The compiled extension module (``epd_cpu_kernels``), or None when it cannot be built
    here (the reason is logged once)."""
    global _EXT, _TRIED
    if _TRIED:
        return _EXT
    with _LOCK:
        if _TRIED:
            return _EXT
        try:
            try:  # the `ninja` wheel's binary, when the venv's bin is not on PATH
                import ninja

                os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
            except ImportError:
                pass
            # its import warns "No CUDA runtime is found" on every CPU-only machine: noise here
            logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
            from torch.utils.cpp_extension import load as build

            _EXT = build(name="epd_cpu_kernels", sources=[str(_CSRC / s) for s in SOURCES],
                         extra_include_paths=[str(_CSRC)],
                         extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"], verbose=False)
        except Exception as e:  # no compiler, no ninja, a read-only cache...
            logger.warning("epd's CPU kernels could not be built (%s: %s); the CPU runs the slower torch "
                           "reference ops", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _EXT = None
        _TRIED = True
    return _EXT
