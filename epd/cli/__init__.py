"""The ``epd`` command line: ``python -m epd.cli`` or the ``epd`` script."""

from epd.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
