"""A NIXL peer process for tests/transfer: owns a NixlTransport and its buffers, polls
notifications while idle, and answers small commands from the test over a Pipe.

(The test-only Pipe carries tuples of ints and bytes; the transport itself never
unpickles anything.)
"""

from __future__ import annotations

import time

import torch


def pattern(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """Deterministic fp32 content, identical in every process of the same torch build."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32)


def serve(conn, name: str, buffers: dict[str, tuple[int, ...]], options: dict) -> None:
    from epd.transfer import NixlTransport

    transport = NixlTransport(name)
    tensors = {k: torch.zeros(shape, dtype=torch.float32) for k, shape in buffers.items()}
    regions = dict(zip(tensors, transport.register(list(tensors.values()))))
    info = {"name": name, "metadata": transport.metadata(), "regions": regions}
    pt = None
    if options.get("progress_thread_us"):
        # Second agent with NIXL's progress thread: completes transfers while we are busy.
        pt = NixlTransport(name + "-pt", progress_thread_us=options["progress_thread_us"])
        pt_buf = torch.zeros(buffers["kv"], dtype=torch.float32)
        info["pt_regions"] = {"kv": pt.register([pt_buf])[0]}
        info["pt_metadata"] = pt.metadata()
        info["pt_name"] = name + "-pt"
    conn.send(info)

    notifs: dict[str, list[bytes]] = {}

    def collect() -> None:
        for src, msgs in transport.get_notifs().items():
            notifs.setdefault(src, []).extend(msgs)

    while True:
        if not conn.poll(0.0002):
            collect()
            continue
        cmd, *args = conn.recv()
        if cmd == "zero":
            tensors[args[0]].zero_()
            conn.send(True)
        elif cmd == "fill":
            buf, seed = args
            tensors[buf].copy_(pattern(tuple(tensors[buf].shape), seed))
            conn.send(True)
        elif cmd == "check_blocks":
            # kv[dst] must equal pattern(seed)[src] bit for bit; every other block zero.
            buf, mapping, seed = args
            t = tensors[buf]
            src = pattern(tuple(t.shape), seed)
            ok = all(torch.equal(t[d], src[s]) for d, s in mapping)
            others = [i for i in range(t.shape[0]) if i not in {d for d, _ in mapping}]
            if others:
                ok = ok and bool((t[others] == 0).all())
            conn.send(ok)
        elif cmd == "is_zero":
            conn.send(bool((tensors[args[0]] == 0).all()))
        elif cmd == "wait_notif":
            src, msg, timeout = args
            deadline = time.monotonic() + timeout
            while msg not in notifs.get(src, []) and time.monotonic() < deadline:
                collect()
                time.sleep(0.0002)
            found = msg in notifs.get(src, [])
            if found:
                notifs[src].remove(msg)
            conn.send(found)
        elif cmd == "notifs":
            collect()
            out = {k: list(v) for k, v in notifs.items() if v}
            notifs.clear()
            conn.send(out)
        elif cmd == "busy":  # compute without polling NIXL
            time.sleep(args[0])
            conn.send(True)
        elif cmd == "pt_notifs":
            conn.send(pt.get_notifs() if pt else {})
        elif cmd == "close":
            if pt is not None:
                pt.close()
            transport.close()
            conn.send(True)
            return
        else:
            conn.send(f"unknown command {cmd!r}")
