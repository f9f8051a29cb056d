"""epd's CPU kernels (``csrc/*.cpp``), one C++ extension built on first use.

It holds the paged decode attention kernel (``paged_decode_cpu.cpp``), the linear layers at
the memory bound for a decode step's few rows (``linear_cpu.cpp``: bf16 with AVX512-BF16,
fp32, int8 weight-only), the element-wise ops of a decoder layer (``elementwise_cpu.cpp``)
and the fused decode step that chains them (``decode_layers_cpu.cpp``, ``FusedDecoder``).
It is compiled once per machine and source content with ``torch.utils.cpp_extension.load``
(g++ and ninja, ``-march=native``; ``make install`` builds it) into torch's extension cache
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``), in a directory named
by a hash of the sources, from a copy of the sources kept there (so every checkout on the
machine writes the same ``build.ninja`` and none triggers another's rebuild); processes that
start while it builds wait on the build's lock file. Where it cannot be built, :func:`load`
returns None once, with a warning, and every caller uses its torch reference.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
SOURCES = ("bindings.cpp", "paged_decode_cpu.cpp", "linear_cpu.cpp", "elementwise_cpu.cpp", "decode_layers_cpu.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp"]
_LOCK = threading.Lock()
_EXT = None
_TRIED = False


def _build_directory(sources: list[str], cflags: list[str]) -> Path:
    """``$TORCH_EXTENSIONS_DIR/epd_cpu_kernels_<hash>``: one build per content of the sources
    (the header included), flags and torch install, so two checkouts of different code or two
    venvs on one machine (a worktree, a fresh clone) never rebuild each other's extension in a
    shared directory."""
    import torch.utils.cpp_extension
    from torch.utils.cpp_extension import _get_build_directory

    h = hashlib.sha256()
    for path in sorted([*sources, str(_CSRC / "cpu_kernels.h")]):
        h.update(Path(path).name.encode() + b"\0" + Path(path).read_bytes())
    h.update(" ".join(cflags).encode())
    # the torch it compiles against (its headers' path stands for the venv): a venv's build
    # never serves another's torch, and two venvs never rewrite each other's build.ninja
    h.update(f"{torch.__version__}|{torch.utils.cpp_extension.include_paths()[0]}".encode())
    root = Path(_get_build_directory("epd_cpu_kernels", verbose=False)).parent
    return root / f"epd_cpu_kernels_{h.hexdigest()[:12]}"


def _stage_sources(build_dir: Path) -> list[str]:
    """Copies ``csrc/`` (sources and header) into ``build_dir/src`` and returns the copies'
    paths. A copy is rewritten only when its bytes differ (atomically, via a temporary file),
    so its mtime, which ninja compares, changes only with its content."""
    src = build_dir / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in (*SOURCES, "cpu_kernels.h"):
        data = (_CSRC / name).read_bytes()
        dst = src / name
        if not dst.exists() or dst.read_bytes() != data:
            tmp = src / f".{name}.{os.getpid()}"
            tmp.write_bytes(data)
            os.replace(tmp, dst)
    return [str(src / s) for s in SOURCES]


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

            build_dir = _build_directory([str(_CSRC / s) for s in SOURCES], _CFLAGS)
            _EXT = build(name="epd_cpu_kernels", sources=_stage_sources(build_dir), extra_cflags=_CFLAGS,
                         extra_ldflags=["-fopenmp"], build_directory=str(build_dir), verbose=False)
        except Exception as e:  # no compiler, no ninja, a read-only cache...
            logger.warning("epd's CPU kernels could not be built (%s: %s); the CPU runs the slower torch "
                           "reference ops", type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            _EXT = None
        _TRIED = True
    return _EXT
