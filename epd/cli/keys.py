"""``epd keys generate``: a new pair of the cluster's CURVE keys."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Register ``epd keys generate`` on the subparsers ``sub``."""
    k = sub.add_parser("keys", help="the cluster's CURVE keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser("generate", help="write a new cluster key pair into DIR (cluster.key, cluster.key_secret)")
    g.add_argument("dir")
    g.add_argument("--force", action="store_true", help="replace keys already there")
    g.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    """Write the key pair into ``args.dir`` and say where it went.

    Raises:
        ClusterKeysError: keys are there already (without ``--force``) or cannot be written.
    """
    from epd.cluster_auth import generate_keys

    secret = generate_keys(args.dir, force=args.force)
    print(f"wrote {secret.parent / 'cluster.key'} and {secret} (keep the secret private; give the directory to "
          f"every epd process of the cluster with --cluster-keys {args.dir} or $EPD_CLUSTER_KEYS)")
    return 0
