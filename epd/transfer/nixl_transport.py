"""One NIXL agent per worker process: register buffers once, move whole regions.

Facts about nixl 1.5.1 that shape this module (read in its source and measured here,
see tests/transfer/test_nixl_transport.py):

- `nixl_agent.get_agent_metadata()` returns the C++ agent's own serialization
  (`nixlSerDes`: a "nixlSerDes|" header, then tag / 8-byte length / value records:
  agent name, UCX connection info, registered sections with their remote keys). It is
  parsed by C++ `loadRemoteMD`, not by pickle, so it may cross a socket. Fuzzed here
  (truncations, byte flips): loading raises `nixlMismatchError` /
  `nixlInvalidParamError` / `nixlBackendError` / ..., never crashes. The metadata only
  lists memory registered *before* it was taken: register first, then advertise.
- `get_serialized_descs` / `deserialize_descs` are `pickle.dumps` / `pickle.loads`:
  never used here. Descriptor tables travel as integer triples (addr, nbytes, dev)
  and are rebuilt locally with `get_xfer_descs(ndarray Nx3, mem_type)`.
- Without a progress thread the *target* of a transfer must drive UCX as well
  (`get_new_notifs`): a new connection never completes while the target neither polls
  nor runs a progress thread, notifications are only seen when it polls, and even on an
  established connection some transfers stay "PROC" until it does (observed after
  notification-carrying transfers). A SIGSTOPped or busy peer can thus leave a transfer
  "PROC" forever; NIXL has no timeout of its own, so every wait here has a deadline
  after which the handle is released. `progress_thread_us` > 0
  starts NIXL's UCX progress thread sleeping that long between sweeps (~2 % of a core
  idle; NIXL's own default of 0 spins half a core) for a worker whose main loop cannot
  poll every millisecond or so (a decode worker mid-step, an encoder mid-batch).
- On CPU UCX moves data with cma (process_vm_writev/readv) inside `transfer()`: the
  initiator's thread does the copy before the call returns, usually "DONE".
- Releasing an unfinished transfer only *starts* its abort (nixl's `release_xfer_handle`
  docstring): when NIXL cannot cancel it, release raises, the handle stays, and posted
  writes or reads can still land. So the memory a released transfer touches is free only
  once it is *terminated* (``Transfer.release`` / ``Transfer.terminated``): NIXL reported
  DONE / ERR or its peer is gone, and its handle is freed.
- A killed peer: `transfer()` / `check_xfer_state()` raise `nixlRemoteDisconnectError`
  within a millisecond. After a request to a dead peer fails, the agent must be
  driven once (`get_new_notifs`) before it is destroyed, or UCX aborts the process at
  teardown (`Assertion ucs_arbiter_group_is_empty`); `remove_peer` and `close` do so.
- `add_remote_agent` returns the peer name as *bytes*; `get_new_notifs` keys are str.
- NIXL itself checks remote descriptors against the peer's registrations
  (`nixlNotFoundError`), but a peer's registrations are not the caller's contract:
  here every remote range must lie inside the regions the peer advertised on the
  control plane, and every local range inside our own registrations, before NIXL is
  called at all.
- One agent holds DRAM and VRAM alike (`register_memory` of CPU / CUDA tensors); a transfer's
  local side is one memory type and its remote side one (VRAM->VRAM over NVLink/RDMA with a CUDA
  UCX). Region triples fold the type into the device field (0 = DRAM, ``1 + i`` = ``cuda:i``).

Not thread-safe: one thread per transport (the optional progress thread is NIXL's own).
"""

from __future__ import annotations

import logging
import re
import time
import weakref
from typing import Any

import numpy as np
import torch

from epd.messages import Region
from epd.transfer.regions import RegionTable, as_region_array, check_disjoint, coalesce, nixl_descs, tensor_region
from epd.transfer.transfer_hold import TransferHold

logger = logging.getLogger(__name__)

_BACKEND = "UCX"
_MAX_METADATA_BYTES = 16 << 20
#: notifications kept unread at most (``get_notifs`` empties the buffer)
_MAX_BUFFERED_NOTIFS = 1 << 16
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@+/-]{0,127}")


class TransferError(RuntimeError):
    """A transfer (or a peer operation) failed: peer gone, NIXL error, closed transport."""


class TransferTimeout(TransferError):
    """The deadline passed; the transfer handle was released (cancelled)."""


def _check_name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ValueError(f"{what} must match {_NAME_RE.pattern}, got {name!r}")
    return name


def _make_agent(name: str, progress_thread_us: int) -> Any:
    from nixl import _api

    config = _api.nixl_agent_config(
        enable_prog_thread=progress_thread_us > 0,
        enable_listen_thread=False,
        backends=[_BACKEND],
    )
    if progress_thread_us <= 0:
        return _api.nixl_agent(name, config)
    # nixl_agent.__init__ hard-codes pthrDelay = 0 (the thread then spins on a core);
    # hand it a bindings shim whose nixlAgent() applies our delay (microseconds).
    real = getattr(_api, "nixlBind", None)
    if real is None or not hasattr(real, "nixlAgent"):
        raise TransferError("this nixl version does not allow setting the progress-thread delay")

    class _Shim:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        @staticmethod
        def nixlAgent(agent_name: str, cfg: Any) -> Any:  # NIXL's name
            cfg.pthrDelay = int(progress_thread_us)
            return real.nixlAgent(agent_name, cfg)

    _api.nixlBind = _Shim()
    try:
        return _api.nixl_agent(name, config)
    finally:
        _api.nixlBind = real


class _Peer:
    __slots__ = ("name", "table")

    def __init__(self, name: str, table: RegionTable):
        self.name = name
        self.table = table


class Transfer:
    """One posted READ or WRITE. Poll it, wait on it with a deadline, or release it
    (``released``); ``terminated``: no byte of it can move any more (done, failed, or
    cancelled and its handle freed), which a released transfer may not yet be."""

    __slots__ = ("op", "peer", "nbytes", "num_descs", "_transport", "_handle", "_done", "_released", "_held",
                 "__weakref__")

    def __init__(self, transport: NixlTransport, handle: Any, op: str, peer: str, nbytes: int, num_descs: int):
        self._transport, self._handle, self.op, self.peer, self.nbytes = transport, handle, op, peer, nbytes
        self.num_descs = num_descs  # descriptors after coalescing
        self._done = self._released = False
        self._held = False  # the hold seam (NixlTransport.hold): not yet handed to NIXL

    def __repr__(self) -> str:
        state = ("done" if self._done else "released" if self.released else "in progress")
        return f"Transfer({self.op} {self.peer}, {self.nbytes} B, {self.num_descs} descs, {state})"

    done = property(lambda self: self._done)

    @property
    def released(self) -> bool:
        """True once the caller gave it up or it ended (completion, failure, timeout, release())."""
        return self._released or self._handle is None

    @property
    def terminated(self) -> bool:
        """True when no byte of it can move any more: polls (and frees) a released transfer
        NIXL could not cancel yet."""
        if self._handle is None:
            return True
        if self._released:
            self._settle()
        return self._handle is None

    def _what(self) -> str:
        return f"{self.op} {'to' if self.op == 'WRITE' else 'from'} peer {self.peer!r} ({self.nbytes} B)"

    def _complete(self) -> None:
        self._done = True
        self.release()
        self._transport.bytes_moved += self.nbytes

    def poll(self) -> bool:
        """True when done; raises TransferError if the transfer failed or was released."""
        if self._done:
            return True
        if self.released:
            raise TransferError(f"{self._what()}: released before completion")
        agent = self._transport._agent
        if agent is None:
            self.release()
            raise TransferError(f"{self._what()}: transport closed")
        self._transport._post_held()
        if self._held:
            return False
        try:
            state = agent.check_xfer_state(self._handle)
        except Exception as e:
            self._free()  # the peer is gone or NIXL gave up on it: terminal
            raise TransferError(f"{self._what()} failed: {type(e).__name__}: {e}") from e
        if state == "DONE":
            self._complete()
            return True
        if state == "PROC":
            return False
        self._free()
        raise TransferError(f"{self._what()} failed: NIXL state {state}")

    def wait(self, timeout_s: float) -> None:
        """Poll until done; past the deadline release it (see ``release``) and raise TransferTimeout."""
        deadline = time.monotonic() + timeout_s
        delay = 50e-6
        while not self.poll():
            now = time.monotonic()
            if now >= deadline:
                ended = self.release()
                raise TransferTimeout(f"{self._what()} not done after {timeout_s:g} s; "
                                      f"{'cancelled' if ended else 'cancel requested, still in flight'}")
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 1e-3)

    def release(self) -> bool:
        """Give the transfer up: free its NIXL handle, which asks NIXL to cancel it if it
        is unfinished. Returns True when it is terminated (its memory may be reused), False
        when NIXL could not cancel it: it may still move data, the handle is kept, and
        ``terminated`` turns True once NIXL reports a terminal state. Idempotent."""
        if self._handle is None:
            return True
        if not self._released:
            self._released = True
            self._transport._live.discard(self)
        if self._settle():
            return True
        self._transport._cancelling.add(self)
        return False

    def _settle(self) -> bool:
        """Try to free the handle of a released transfer; True once it is freed."""
        if self._held:
            self._transport._post_held()  # NIXL would have posted it: it still lands
            if self._held:
                return False
        try:
            self._handle.release()
        except Exception as e:  # NIXL could not cancel it (yet): still in flight
            logger.debug("release of %s deferred: %s", self._what(), e)
            return False
        self._handle = None
        self._transport._cancelling.discard(self)
        return True

    def _free(self) -> None:
        """Free the handle of a transfer NIXL reported terminal (ERR, or its peer failed)."""
        self._released = True
        self._transport._live.discard(self)
        self._transport._cancelling.discard(self)
        handle, self._handle = self._handle, None
        try:
            handle is not None and handle.release()
        except Exception as e:
            logger.debug("release of failed %s: %s", self._what(), e)


class NixlTransport(TransferHold):
    """One NIXL agent per worker process (UCX backend; callers poll unless
    `progress_thread_us` > 0 starts NIXL's progress thread with that sleep). It registers
    host and CUDA tensors alike (DRAM / VRAM, see the module docstring).
    Tests hold its transfers in flight with the hold seam (:class:`TransferHold`).
    """

    def __init__(self, name: str, *, progress_thread_us: int = 0):
        self.name = _check_name(name, "agent name")
        self.num_requests = 0  # READ/WRITE requests posted
        self.bytes_moved = 0  # bytes of requests that completed
        self._tensors: list[torch.Tensor] = []
        self._regs: list[Any] = []
        self._local: RegionTable | None = None
        self._peers: dict[str, _Peer] = {}
        self._notifs: dict[str, list[bytes]] = {}
        self._num_buffered = 0  # notifications in ``_notifs``
        self._live: weakref.WeakSet[Transfer] = weakref.WeakSet()
        self._cancelling: set[Transfer] = set()  # released, not yet terminated (kept alive to be polled)
        self._init_hold(name)
        self._metadata_taken = False
        self._agent: Any = None
        try:
            agent = _make_agent(name, int(progress_thread_us))
        except TransferError:
            raise
        except Exception as e:
            raise TransferError(f"agent {name!r}: NIXL agent creation failed: {type(e).__name__}: {e}") from e
        if _BACKEND not in agent.backends:
            raise TransferError(f"agent {name!r}: NIXL {_BACKEND} backend unavailable")
        self._agent = agent

    def __repr__(self) -> str:
        return f"NixlTransport({self.name!r}, peers={sorted(self._peers)})"

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def _require_open(self, what: str) -> Any:
        if self._agent is None:
            raise TransferError(f"agent {self.name!r}: {what} on a closed transport")
        return self._agent

    # -- memory -------------------------------------------------------------------------

    def register(self, tensors: list[torch.Tensor]) -> list[Region]:
        """Register contiguous CPU or CUDA tensors (DRAM / VRAM; kept alive until close);
        returns their regions (``tensor_region``). Take `metadata()` after the last
        register(): it lists only what was registered.

        Raises:
            TypeError / ValueError: not a non-empty list of contiguous, non-empty tensors,
                or ranges overlapping what is registered. TransferError: NIXL refused.
        """
        agent = self._require_open("register")
        if isinstance(tensors, torch.Tensor) or not tensors:
            raise ValueError("register() takes a non-empty list of tensors")
        regions = []
        groups: dict[torch.device, list[torch.Tensor]] = {}  # NIXL registers one memory type a call
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"register() takes tensors, got {type(t).__name__}")
            if t.device.type not in ("cpu", "cuda"):
                raise ValueError(f"register() takes CPU or CUDA tensors, got {t.device}")
            if not t.is_contiguous() or t.numel() == 0:
                raise ValueError("tensors must be contiguous and non-empty")
            regions.append(tensor_region(t))
            groups.setdefault(t.device, []).append(t)
        arr = as_region_array(regions, "register")
        merged = arr if self._local is None else np.concatenate([self._local.arr, arr])
        table = RegionTable(merged, "register (regions overlap an existing registration)")
        for group in groups.values():
            try:
                reg = agent.register_memory(group, backends=[_BACKEND])
            except Exception as e:
                raise TransferError(f"agent {self.name!r}: register_memory failed: {type(e).__name__}: {e}") from e
            self._regs.append(reg)
        self._tensors.extend(tensors)
        self._local = table
        if self._metadata_taken:
            logger.warning("%s: memory registered after metadata() was taken; peers must reload it", self.name)
        return regions

    def metadata(self) -> bytes:
        """This agent's metadata for peers (nixlSerDes bytes, not pickle)."""
        agent = self._require_open("metadata")
        self._metadata_taken = True
        return bytes(agent.get_agent_metadata())

    # -- peers --------------------------------------------------------------------------

    def add_peer(self, metadata: bytes, regions: list[Region], name: str | None = None) -> str:
        """Load a peer's metadata; remember the regions it advertised (the only ranges
        write/read will touch on it; host or device memory by their device field).
        Returns the peer's agent name.

        ``name``: the agent name the peer was advertised under. A known peer of that name
        is dropped first (releasing its transfers): a process restarted under its old
        name has new metadata, and NIXL refuses a second agent under a known name
        (``NIXL_ERR_NOT_ALLOWED``). The metadata must then carry that name.

        Raises:
            TypeError: metadata is not bytes.
            TransferError: metadata empty, too large, unusable, or naming another agent
                than ``name``; nothing is kept loaded.
        """
        agent = self._require_open("add_peer")
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise TypeError(f"metadata must be bytes, got {type(metadata).__name__}")
        metadata = bytes(metadata)
        table = RegionTable(as_region_array(regions, "peer regions"), "peer regions")
        if not metadata or len(metadata) > _MAX_METADATA_BYTES:
            raise TransferError(f"agent {self.name!r}: add_peer: metadata of {len(metadata)} bytes rejected")
        if name is not None:
            try:
                _check_name(name, "peer name")
            except ValueError as e:
                raise TransferError(f"agent {self.name!r}: add_peer: {e}") from e
            self.remove_peer(name)  # a restarted peer under its old name (no-op when unknown)
        try:
            raw = agent.add_remote_agent(metadata)
        except Exception as e:
            raise TransferError(
                f"agent {self.name!r}: add_peer: malformed or unusable metadata ({type(e).__name__}: {e})"
            ) from e
        raw_bytes = raw if isinstance(raw, bytes) else str(raw).encode()
        try:
            loaded = _check_name(raw_bytes.decode("utf-8"), "peer name")
        except (UnicodeDecodeError, ValueError) as e:
            self._unload(raw_bytes)
            raise TransferError(f"agent {self.name!r}: add_peer: bad peer name {raw_bytes[:64]!r}") from e
        if name is not None and loaded != name:  # never trust the advertised name
            if loaded not in self._peers:  # (a known peer's identical metadata loads as a no-op)
                self._unload(raw_bytes)
            raise TransferError(f"agent {self.name!r}: add_peer: the metadata names agent {loaded!r}, "
                                f"advertised as {name!r}")
        if loaded in self._peers:  # the same metadata again: start afresh
            self.remove_peer(loaded)
            try:
                agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"agent {self.name!r}: add_peer {loaded!r} failed: {type(e).__name__}: {e}") from e
        self._peers[loaded] = _Peer(loaded, table)
        return loaded

    def _unload(self, raw_name: bytes) -> None:
        """Drop a remote agent NIXL loaded but this transport does not keep."""
        try:
            self._agent.remove_remote_agent(raw_name)
        except Exception:
            pass

    def remove_peer(self, peer: str) -> None:
        """Forget a peer: release its transfers, disconnect. Unknown peers are ignored."""
        if self._agent is None or peer not in self._peers:
            return
        for t in [*self._live, *self._cancelling]:
            if t.peer == peer:
                t._free()  # the peer is gone (or replaced): nothing of it lands any more
        self._held = [t for t in self._held if t.peer != peer]
        self._progress_quietly()  # see module docstring: UCX must see the error first
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as e:
            logger.warning("%s: remove_remote_agent(%s) failed: %s", self.name, peer, e)
        del self._peers[peer]

    @property
    def peers(self) -> list[str]:
        return sorted(self._peers)

    # -- transfers ----------------------------------------------------------------------

    def write(self, peer: str, local: list[Region], remote: list[Region], notif: bytes = b"") -> Transfer:
        """Post a WRITE of local[i] into remote[i] on `peer`; `notif` reaches the peer
        after the data. Raises (nothing sent) ValueError for bad ranges, TransferError for a
        remote range outside what the peer advertised (a stale ref after its restart: retryable)."""
        return self._post("WRITE", peer, local, remote, notif)

    def read(self, peer: str, local: list[Region], remote: list[Region], notif: bytes = b"") -> Transfer:
        """Post a READ of remote[i] on `peer` into local[i]; `notif` reaches the peer
        after the data. Raises (nothing sent) ValueError for bad ranges, TransferError for a
        remote range outside what the peer advertised (a stale ref after its restart: retryable)."""
        return self._post("READ", peer, local, remote, notif)

    def _post(self, op: str, peer: str, local: Any, remote: Any, notif: bytes) -> Transfer:
        agent = self._require_open(op)
        if not isinstance(notif, bytes):
            raise TypeError(f"notif must be bytes, got {type(notif).__name__}")
        p = self._peers.get(peer)
        if p is None:
            raise TransferError(f"agent {self.name!r}: {op} to unknown peer {peer!r}")
        if self._local is None:
            raise ValueError(f"{op}: no local memory registered")
        ldesc = as_region_array(local, f"{op} local")
        rdesc = as_region_array(remote, f"{op} remote")
        if len(ldesc) != len(rdesc):
            raise ValueError(f"{op}: {len(ldesc)} local regions vs {len(rdesc)} remote regions")
        mismatch = ldesc[:, 1] != rdesc[:, 1]
        if mismatch.any():
            i = int(np.flatnonzero(mismatch)[0])
            raise ValueError(f"{op}: length mismatch at #{i}: local {int(ldesc[i, 1])} vs remote {int(rdesc[i, 1])}")
        lidx = self._local.locate(ldesc, f"{op} local region (not inside this agent's registrations)")
        try:
            ridx = p.table.locate(rdesc, f"{op} remote region (not inside what peer {peer!r} advertised)")
        except ValueError as e:  # a stale ref (the peer restarted) or a buggy peer: ours to retry, not the client's
            raise TransferError(str(e)) from None
        check_disjoint(rdesc if op == "WRITE" else ldesc, f"{op} destination")
        nbytes = int(ldesc[:, 1].sum())
        ldesc, rdesc = coalesce(ldesc, rdesc, lidx, ridx)
        lmem, lnixl = nixl_descs(ldesc, f"{op} local")
        rmem, rnixl = nixl_descs(rdesc, f"{op} remote")
        try:
            lx = agent.get_xfer_descs(lnixl, lmem)
            rx = agent.get_xfer_descs(rnixl, rmem)
            if lx is None or rx is None:
                raise TransferError("descriptor list construction failed")
            handle = agent.initialize_xfer(op, lx, rx, peer, notif, backends=[_BACKEND])
        except Exception as e:
            raise TransferError(f"{op} {'to' if op == 'WRITE' else 'from'} peer {peer!r}: "
                                f"{type(e).__name__}: {e}") from e
        t = Transfer(self, handle, op, peer, nbytes, len(ldesc))
        self.num_requests += 1
        if self._holding():
            return self._hold(t)
        try:
            state = agent.transfer(handle)
        except Exception as e:
            t.release()
            raise TransferError(f"{t._what()} failed to post: {type(e).__name__}: {e}") from e
        if state == "DONE":
            t._complete()
        elif state == "PROC":
            self._live.add(t)
        else:
            t.release()
            raise TransferError(f"{t._what()} failed to post: NIXL state {state}")
        return t

    num_cancelling = property(lambda self: len(self._cancelling), doc="Released transfers not terminated yet")

    # -- notifications ------------------------------------------------------------------

    def _progress(self) -> None:
        new = self._agent.get_new_notifs()
        for src, msgs in new.items():
            key = src.decode("utf-8", "replace") if isinstance(src, bytes) else str(src)
            room = _MAX_BUFFERED_NOTIFS - self._num_buffered
            if len(msgs) > room:  # a process that reads none (or a flooding peer): never unbounded
                logger.warning("%s: %d notification(s) from %s dropped: %d unread already", self.name,
                               len(msgs) - room, key, self._num_buffered)
                msgs = msgs[:room]
            self._notifs.setdefault(key, []).extend(bytes(m) for m in msgs)
            self._num_buffered += len(msgs)
        self._post_held()
        for t in list(self._cancelling):
            t._settle()

    def _progress_quietly(self) -> None:
        try:
            self._progress()
        except Exception as e:
            logger.debug("%s: progress failed: %s", self.name, e)

    def get_notifs(self) -> dict[str, list[bytes]]:
        """New notifications {peer name: [msg, ...]} since the last call. Also drives UCX
        progress: a process that is the *target* of transfers must call this often."""
        self.progress()
        out, self._notifs, self._num_buffered = self._notifs, {}, 0
        return out

    def progress(self) -> None:
        """Drive UCX once. Without NIXL's progress thread, a new endpoint wires up, and a
        notification posted on one that is not wired up yet leaves, only while this agent
        is progressed (a handful of rounds, each side answering the other): a notification
        sent by a process that then never calls this is never delivered. A worker calls
        it every loop turn. Notifications that arrive are kept for ``get_notifs``.

        Raises:
            TransferError: UCX progress failed.
        """
        self._require_open("progress")
        try:
            self._progress()
        except Exception as e:
            raise TransferError(f"agent {self.name!r}: progress failed: {type(e).__name__}: {e}") from e

    def send_notif(self, peer: str, msg: bytes) -> None:
        """Post a notification to ``peer``; it leaves as this agent is progressed (see
        ``progress``).

        Raises:
            TypeError: ``msg`` is not bytes.
            TransferError: unknown peer, or NIXL refused it.
        """
        agent = self._require_open("send_notif")
        if not isinstance(msg, bytes):
            raise TypeError(f"msg must be bytes, got {type(msg).__name__}")
        if peer not in self._peers:
            raise TransferError(f"agent {self.name!r}: send_notif to unknown peer {peer!r}")
        try:
            agent.send_notif(peer, msg)
        except Exception as e:
            raise TransferError(f"send_notif to peer {peer!r} failed: {type(e).__name__}: {e}") from e

    # -- teardown -----------------------------------------------------------------------

    def close(self) -> None:
        """Release transfers, disconnect peers, deregister memory, drop the agent. Idempotent."""
        agent = self._agent
        if agent is None:
            return
        self._held.clear()
        for t in [*self._live, *self._cancelling]:
            t._free()
        self._progress_quietly()
        for peer in list(self._peers):
            try:
                agent.remove_remote_agent(peer)
            except Exception as e:
                logger.debug("%s: remove_remote_agent(%s) at close: %s", self.name, peer, e)
        self._peers.clear()
        for reg in self._regs:
            try:
                agent.deregister_memory(reg, backends=[_BACKEND])
            except Exception as e:
                logger.debug("%s: deregister_memory at close: %s", self.name, e)
        self._progress_quietly()
        self._regs.clear()
        self._tensors.clear()
        self._local = None
        self._cancelling.clear()
        self._notifs.clear()
        self._agent = None
