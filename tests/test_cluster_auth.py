"""epd.cluster_auth: the router pair and the member pair, and who each side's servers admit."""

from __future__ import annotations

import stat

import pytest
import zmq
import zmq.auth

from epd.cluster_auth import MEMBER, ROUTER, ClusterKeysError, generate_keys, load_keys


def _delivered(server_keys, client_keys, serverkey: bytes | None = None) -> tuple[bool, int]:
    """Bind a CURVE server with ``server_keys`` (its ZAP handler running), connect a client
    with ``client_keys`` (naming ``serverkey``, default the one it expects) and push one
    message: (whether it arrived within 2 s, handshakes the handler refused)."""
    ctx = zmq.Context()
    denied = []
    auth = server_keys.start_authenticator(ctx, lambda: denied.append(1))
    try:
        pull = ctx.socket(zmq.PULL)
        server_keys.server(pull)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        client_keys.client(push)
        if serverkey is not None:
            push.curve_serverkey = serverkey
        push.connect(f"tcp://127.0.0.1:{port}")
        try:
            push.send(b"command", zmq.NOBLOCK)
        except zmq.Again:
            pass
        got = bool(pull.poll(2000))
        return got, len(denied)
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def test_generate_writes_two_pairs_with_private_secrets(tmp_path):
    d = generate_keys(tmp_path / "k")
    assert {p.name for p in d.iterdir()} == {"router.key", "router.key_secret", "member.key", "member.key_secret"}
    for name in ("router.key_secret", "member.key_secret"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    with pytest.raises(ClusterKeysError, match="--force"):
        generate_keys(d)
    router, member = load_keys(d, ROUTER), load_keys(d, MEMBER)
    assert router.peer_public == member.public and member.peer_public == router.public
    assert router.secret != member.secret


def test_each_side_loads_from_just_its_two_files(tmp_path):
    full = generate_keys(tmp_path / "full")
    for side, files in ((ROUTER, ("router.key_secret", "member.key")), (MEMBER, ("member.key_secret", "router.key"))):
        d = tmp_path / side
        d.mkdir()
        for f in files:
            (d / f).write_bytes((full / f).read_bytes())
        assert load_keys(d, side).side == side
        other = MEMBER if side == ROUTER else ROUTER
        with pytest.raises(ClusterKeysError, match="every worker member.key_secret and router.key"):
            load_keys(d, other)  # a worker's Secret holds no router secret, and the reverse


def test_a_single_shared_pair_of_an_earlier_version_is_refused(tmp_path):
    zmq.auth.create_certificates(str(tmp_path), "cluster")
    with pytest.raises(ClusterKeysError, match="epd keys generate --force"):
        load_keys(tmp_path, MEMBER)


def test_only_the_router_key_reaches_a_worker_and_only_the_member_key_the_router(tmp_path):
    d = generate_keys(tmp_path / "k")
    router, member = load_keys(d, ROUTER), load_keys(d, MEMBER)
    assert _delivered(member, router) == (True, 0)  # router -> worker command socket
    assert _delivered(router, member) == (True, 0)  # worker -> router inbox
    # A member-key holder naming the worker's real server key (the member public key): refused by ZAP.
    got, denied = _delivered(member, member, serverkey=member.public)
    assert not got and denied >= 1
    # The router key at the router's own inbox is no member either.
    got, denied = _delivered(router, router, serverkey=router.public)
    assert not got and denied >= 1
    stranger = load_keys(generate_keys(tmp_path / "other"), ROUTER)
    got, _ = _delivered(member, stranger, serverkey=member.public)
    assert not got
