"""Parse and validate ``epd launch --pools ... --tp ...``.

``--pools`` counts devices per pool (GPUs; on CPU, worker processes)::

    e:2,p:4,d:8     2 encode, 4 prefill, 8 decode devices (disaggregated)
    e:1,pd:2        1 encode device, 2 aggregated prefill+decode devices
    p:1,d:1         no encode pool (text only); ``e:0`` says the same

``--tp`` sets the tensor-parallel size of the prefill / decode / aggregated pools::

    p:4,d:1         one prefill instance of 4 ranks, decode instances of 1 rank

An instance is ``tp`` consecutive devices of a pool, so a pool has
``devices // tp`` instances. Encoders are not tensor-parallel: every encode device
is its own instance. Every error is a :class:`LaunchSpecError` whose message says
what is wrong and shows a valid example.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from epd.roles import ROLE_SHORT, Role

__all__ = ["LaunchSpecError", "PoolSpec", "ROLES", "parse_pools", "parse_tp", "build_launch_plan"]

#: canonical roles, in launch order
ROLES = tuple(Role)
#: pools that may be 0 (dropped: no such pool) and take no TP: one device per instance
OPTIONAL_POOLS = (Role.ENCODE, Role.TTS)
_ALIASES = {
    "e": Role.ENCODE, "enc": Role.ENCODE, "encode": Role.ENCODE, "encoder": Role.ENCODE,
    "p": Role.PREFILL, "prefill": Role.PREFILL,
    "d": Role.DECODE, "decode": Role.DECODE,
    "pd": Role.PD, "aggregated": Role.PD,
    "t": Role.TTS, "tts": Role.TTS,
}
_POOLS_EXAMPLE = ("--pools e:2,p:4,d:8 (disaggregated), --pools e:1,pd:2 (aggregated prefill+decode) or "
                  "--pools e:1,p:1,d:1,t:1 (with a text-to-speech pool)")
_TP_EXAMPLE = "--tp p:4,d:1"
_INT = re.compile(r"[0-9]+")


class LaunchSpecError(ValueError):
    """An ``epd launch`` setting is invalid; the message says what and shows a valid example."""


@dataclass(frozen=True)
class PoolSpec:
    """One pool of the launch plan.

    Attributes:
        role: the pool's :class:`~epd.roles.Role`: encode, prefill, decode, pd (aggregated
            prefill+decode) or tts (text-to-speech).
        devices: devices (processes on CPU) in the pool; one process per device.
        tp: tensor-parallel ranks per instance (always 1 for encode and tts).
    """

    role: Role
    devices: int
    tp: int = 1

    @property
    def instances(self) -> int:
        """Number of instances: ``devices // tp``."""
        return self.devices // self.tp

    def instance_ids(self) -> list[str]:
        """``["<role>-0", "<role>-1", ...]``, one per instance."""
        return [f"{self.role}-{i}" for i in range(self.instances)]


def _split_items(text: str, flag: str, example: str) -> list[tuple[str, str, str]]:
    """``"a:1, b:2"`` -> [(item, key, value)], rejecting malformed items."""
    items = []
    for raw in text.split(","):
        item = raw.strip()
        if not item:
            raise LaunchSpecError(f"{flag} {text!r} has an empty entry (stray comma?); "
                                  f"write ROLE:COUNT entries separated by commas, e.g. {example}")
        if item.count(":") != 1:
            raise LaunchSpecError(f"{flag} entry {item!r} is not ROLE:COUNT; e.g. {example}")
        key, value = (s.strip() for s in item.split(":"))
        items.append((item, key.lower(), value))
    return items


def _role(key: str, item: str, flag: str, example: str) -> Role:
    role = _ALIASES.get(key)
    if role is None:
        raise LaunchSpecError(
            f"{flag} entry {item!r}: unknown role {key!r}; roles are e (encode), p (prefill), "
            f"d (decode) and pd (aggregated prefill+decode); e.g. {example}")
    return role


def _count(value: str, item: str, flag: str, example: str) -> int:
    if not _INT.fullmatch(value):
        raise LaunchSpecError(f"{flag} entry {item!r}: {value!r} is not a whole number; e.g. {example}")
    return int(value)


def parse_pools(text: str) -> dict[Role, int]:
    """Parse ``--pools``: role -> device count, in launch order (encode, prefill, decode, pd).

    Roles are ``e``/``encode``, ``p``/``prefill``, ``d``/``decode``, ``pd``, ``t``/``tts``.
    Counts are whole numbers >= 1, except ``e:0`` and ``t:0`` (no encode / text-to-speech
    pool, dropped from the result). Either both ``p`` and ``d`` or ``pd`` alone must be given.

    Raises:
        LaunchSpecError: empty text, malformed entry, unknown role, duplicate role,
            non-integer or zero count, pd mixed with p/d, p without d or d without p.
    """
    if text is None or not str(text).strip():
        raise LaunchSpecError(f"--pools is empty; give device counts per pool, e.g. {_POOLS_EXAMPLE}")
    text = str(text).strip()
    counts: dict[Role, int] = {}
    for item, key, value in _split_items(text, "--pools", _POOLS_EXAMPLE):
        role = _role(key, item, "--pools", _POOLS_EXAMPLE)
        if role in counts:
            raise LaunchSpecError(f"--pools {text!r} names the {role} pool twice; "
                                  f"give each pool once, e.g. {_POOLS_EXAMPLE}")
        n = _count(value, item, "--pools", _POOLS_EXAMPLE)
        if n < 1 and role not in OPTIONAL_POOLS:
            raise LaunchSpecError(f"--pools entry {item!r}: a {role} pool needs at least 1 device "
                                  f"(only the encode and tts pools may be 0 to disable them); e.g. {_POOLS_EXAMPLE}")
        counts[role] = n
    has_pd = Role.PD in counts
    if has_pd and (Role.PREFILL in counts or Role.DECODE in counts):
        raise LaunchSpecError(
            f"--pools {text!r} mixes an aggregated pd pool with separate p/d pools; use either "
            f"p and d (disaggregated, e.g. --pools e:1,p:1,d:1) or pd alone (aggregated, e.g. --pools e:1,pd:2)")
    if not has_pd:
        missing = [ROLE_SHORT[r] for r in (Role.PREFILL, Role.DECODE) if r not in counts]
        if missing:
            raise LaunchSpecError(
                f"--pools {text!r} has no {' and no '.join(missing)} pool; a disaggregated setup needs "
                f"both p and d (e.g. --pools e:1,p:1,d:1), an aggregated one pd (e.g. --pools e:1,pd:1)")
    return {r: counts[r] for r in ROLES if counts.get(r)}


def parse_tp(text: str | None, pools: dict[Role, int]) -> dict[Role, int]:
    """Parse ``--tp`` against the parsed pools: role -> TP size for every pool (default 1).

    Only prefill, decode and pd pools take a TP size; it must be >= 1 and divide the
    pool's device count.

    Raises:
        LaunchSpecError: malformed entry, unknown or duplicate role, TP for the encode
            pool, TP for a pool that ``--pools`` does not have, TP that does not
            divide the pool's devices.
    """
    tp = {role: 1 for role in pools}
    if text is None or not str(text).strip():
        return tp
    text = str(text).strip()
    pools_text = ",".join(f"{ROLE_SHORT[r]}:{n}" for r, n in pools.items())
    seen: set[Role] = set()
    for item, key, value in _split_items(text, "--tp", _TP_EXAMPLE):
        role = _role(key, item, "--tp", _TP_EXAMPLE)
        if role in OPTIONAL_POOLS:
            raise LaunchSpecError(
                f"--tp entry {item!r}: the {role} pool has no tensor parallelism (every {role} device "
                f"is its own instance; scale it with --pools {ROLE_SHORT[role]}:N); give TP for p, d or pd only, "
                f"e.g. {_TP_EXAMPLE}")
        if role in seen:
            raise LaunchSpecError(f"--tp {text!r} names the {role} pool twice; e.g. {_TP_EXAMPLE}")
        seen.add(role)
        n = _count(value, item, "--tp", _TP_EXAMPLE)
        if n < 1:
            raise LaunchSpecError(f"--tp entry {item!r}: TP size must be at least 1; e.g. {_TP_EXAMPLE}")
        if role not in pools:
            raise LaunchSpecError(
                f"--tp entry {item!r}: --pools {pools_text} has no {role} pool; set TP only for "
                f"pools that exist (e.g. --pools e:2,p:4,d:8 --tp p:4,d:1)")
        devices = pools[role]
        if devices % n:
            divisors = [k for k in range(1, devices + 1) if devices % k == 0]
            raise LaunchSpecError(
                f"--tp entry {item!r}: TP {n} does not divide the {devices} devices of the {role} pool "
                f"(--pools {pools_text}); each instance takes TP devices, so use one of "
                f"{', '.join(map(str, divisors))} or change the pool size (e.g. --pools e:2,p:4,d:8 --tp p:4,d:1)")
        tp[role] = n
    return tp


def build_launch_plan(pools_text: str, tp_text: str | None, *, num_attention_heads: int,
                      num_kv_heads: int | None = None) -> list[PoolSpec]:
    """The validated launch plan: one :class:`PoolSpec` per pool, in launch order.

    Args:
        pools_text: ``--pools`` value, e.g. ``"e:2,p:4,d:8"``.
        tp_text: ``--tp`` value, e.g. ``"p:4,d:1"``, or None (TP 1 everywhere).
        num_attention_heads: the language model's attention heads.
        num_kv_heads: its KV heads (None: same as attention heads, i.e. MHA).

    Raises:
        LaunchSpecError: any invalid spec, or a TP size that does not divide the model's
            attention heads and KV heads (the message names the model's head counts).
    """
    pools = parse_pools(pools_text)
    tp = parse_tp(tp_text, pools)
    kv = num_kv_heads or num_attention_heads
    for role, n in tp.items():
        if role in OPTIONAL_POOLS or n == 1:
            continue
        if num_attention_heads % n or kv % n:
            valid = [k for k in range(1, min(num_attention_heads, kv) + 1)
                     if num_attention_heads % k == 0 and kv % k == 0]
            raise LaunchSpecError(
                f"--tp {ROLE_SHORT[role]}:{n}: TP {n} must divide the model's {num_attention_heads} attention "
                f"heads and {kv} KV heads (heads are sharded over TP ranks); TP sizes this model "
                f"allows: {', '.join(map(str, valid))}"
                + ("; prefill and decode TP may differ (KV is restaged between them), but each must split "
                   "the KV heads" if Role.PREFILL in tp and Role.DECODE in tp else ""))
    return [PoolSpec(role, devices, tp[role]) for role, devices in pools.items()]
