"""Worker roles: the pools a worker process belongs to (see docs/architecture.md, "Processes").

:class:`Role` is a :class:`enum.StrEnum`, so a member *is* its string: it compares
and hashes equal to the plain name (``Role.PREFILL == "prefill"``, dict lookups by
either work), formats as it (``f"{Role.DECODE}-0" == "decode-0"``), and msgspec
encodes it by value, so wire messages and metric labels are unchanged. Its repr
is the string's too (``'prefill'``), so messages that show a role, or a dict or
tuple of roles, read as they did when roles were plain strings.
"""

from __future__ import annotations

import enum

__all__ = ["Role", "ROLE_NAMES", "ROLE_SHORT"]


class Role(enum.StrEnum):
    """A worker pool, in launch order."""

    ENCODE = "encode"  # multimodal encoders: images/audio -> embeddings
    PREFILL = "prefill"  # prompt prefill; hands its KV to a decode worker
    DECODE = "decode"  # token generation from a transferred KV cache
    PD = "pd"  # aggregated prefill+decode in one engine
    TTS = "tts"  # text-to-speech: an answer's phrases -> PCM audio (the realtime API's speech out)

    __repr__ = str.__repr__  # 'prefill', not <Role.PREFILL: 'prefill'> (see the module doc)


#: the role names as plain strings, in launch order (for argparse choices and messages)
ROLE_NAMES: tuple[str, ...] = tuple(r.value for r in Role)

#: each role's short name in ``--pools`` / ``--tp`` specs (``e:2,p:4,d:8``)
ROLE_SHORT: dict[Role, str] = {Role.ENCODE: "e", Role.PREFILL: "p", Role.DECODE: "d", Role.PD: "pd", Role.TTS: "t"}
