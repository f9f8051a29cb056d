"""Worker processes of the E, P, D and aggregated pools (``epd worker --role ...``)."""

from __future__ import annotations

from epd.workers.base import WorkerArgs

ROLES = ("encode", "prefill", "decode", "pd")


def run_worker(args: WorkerArgs) -> None:
    """Build the worker for ``args.role`` and run its loop until shutdown."""
    if args.role == "encode":
        from epd.workers.encode_worker import EncodeWorker as cls
    elif args.role == "prefill":
        from epd.workers.prefill_worker import PrefillWorker as cls
    elif args.role == "decode":
        from epd.workers.decode_worker import DecodeWorker as cls
    elif args.role == "pd":
        from epd.workers.aggregated_worker import AggregatedWorker as cls
    else:
        raise ValueError(f"unknown worker role {args.role!r}; expected one of {ROLES}")
    cls(args).run()
