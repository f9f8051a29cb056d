"""``epd keys generate``: the cluster's CURVE keys, a router pair and a member pair."""

from __future__ import annotations

import argparse


def add_parser(sub) -> None:
    """Register ``epd keys generate`` on the subparsers ``sub``."""
    k = sub.add_parser("keys", help="the cluster's CURVE keys")
    ksub = k.add_subparsers(dest="keys_command", required=True)
    g = ksub.add_parser("generate", help="write a new router key pair and member key pair into DIR "
                                         "(router.key, router.key_secret, member.key, member.key_secret)")
    g.add_argument("dir")
    g.add_argument("--force", action="store_true", help="replace keys already there")
    g.set_defaults(func=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace) -> int:
    """Write both key pairs into ``args.dir`` and say which process needs which files.

    Raises:
        ClusterKeysError: keys are there already (without ``--force``) or cannot be written.
    """
    from epd.cluster_auth import generate_keys

    d = generate_keys(args.dir, force=args.force)
    print(f"wrote the router pair ({d / 'router.key'}, {d / 'router.key_secret'}) and the member pair "
          f"({d / 'member.key'}, {d / 'member.key_secret'}). Keep the secrets private: `epd serve` needs "
          f"router.key_secret and member.key, every `epd worker` member.key_secret and router.key (pass the "
          f"directory with --cluster-keys or $EPD_CLUSTER_KEYS; one directory with all four serves both on one host)")
    return 0
