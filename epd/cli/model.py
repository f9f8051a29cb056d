"""``epd model create-tiny``: a tiny random checkpoint for tests and benchmarks."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    """Register ``epd model create-tiny`` on the subparsers ``sub``."""
    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_command", required=True)
    ct = msub.add_parser("create-tiny", help="write a tiny random checkpoint for tests and benchmarks")
    ct.add_argument("kind", choices=["llama", "qwen2", "qwen3", "llava", "llava-siglip", "qwen2-audio", "qwen2-vl",
                                     "qwen2.5-vl"])
    ct.add_argument("dir")
    ct.add_argument("--seed", type=int, default=0)
    ct.add_argument("--force", action="store_true", help="write into a non-empty directory")
    ct.set_defaults(func=cmd_create_tiny)


def cmd_create_tiny(args: argparse.Namespace) -> int:
    """Write the checkpoint and print its directory; 2 when the directory holds files (without ``--force``)."""
    from pathlib import Path

    from epd.models.tiny import create_tiny_model

    out = Path(args.dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not args.force:
        print(f"epd model create-tiny: {out} exists and is not an empty directory; pick a new path "
              f"or pass --force to write into it", file=sys.stderr)
        return 2
    path = create_tiny_model(args.kind, args.dir, seed=args.seed)
    print(path)
    return 0
