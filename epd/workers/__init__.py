"""Worker processes of the E, P, D, aggregated and text-to-speech pools (``epd worker --role ...``)."""

from __future__ import annotations

from epd.roles import Role
from epd.workers.base import WorkerArgs

ROLES = tuple(Role)


def run_worker(args: WorkerArgs) -> int:
    """Build the worker for ``args.role`` and run its loop until shutdown; its exit code
    (0: shut down or drained)."""
    if args.role == Role.ENCODE:
        from epd.workers.encode_worker import EncodeWorker as cls
    elif args.role == Role.PREFILL:
        from epd.workers.prefill_worker import PrefillWorker as cls
    elif args.role == Role.DECODE:
        from epd.workers.decode_worker import DecodeWorker as cls
    elif args.role == Role.PD:
        from epd.workers.aggregated_worker import AggregatedWorker as cls
    elif args.role == Role.TTS:
        from epd.workers.tts_worker import TTSWorker as cls
    else:
        raise ValueError(f"unknown worker role {args.role!r}; expected one of {ROLES}")
    return cls(args).run()
