"""An authenticated control plane across hosts: e:1,p:1,d:1 (tiny LLaVA) on four hosts.

- An image request's greedy answer across hosts equals the offline engine's (whose
  tokens the encoder/engine tests prove equal to transformers).
- A peer without the cluster keys (plain ZeroMQ, or CURVE with keys of its own)
  connects to the router's and every worker's port and sends WorkerReady, Abort,
  Shutdown, EncodeRequest and KV events: none has any effect (membership in
  ``/epd/workers``, answers, the encoder-cache counters, a stream in flight).
- A member (it holds the member key, as every worker and encoder does) connects to
  every worker's command socket and sends Shutdown, PeerInfo, Registered and Abort:
  only the router's key opens a command socket, so none has any effect, and each worker
  counts the refusals (``epd_auth_denied_total``).
- A member claiming a live instance id is refused (``RegistrationRefused``).
- Binding anything but loopback without keys refuses to start, naming the fix.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

import httpx
import pytest
import torch
import zmq

from epd import LLM, SamplingParams
from epd.messages import (
    Abort,
    EncodeRequest,
    KVEvents,
    PeerInfo,
    Registered,
    RegistrationRefused,
    Shutdown,
    WorkerReady,
    decode,
    encode,
)
from epd.models.tiny import IMAGE_TOKEN, create_tiny_model
from epd.multimodal import MediaItem
from tests.cluster.deployment import Deployment
from tests.cluster.netns import Cluster, netns_available
from tests.conftest import metric_sum
from tests.serving.media import data_url, png

pytestmark = pytest.mark.slow

_why = netns_available()
if _why is not None:
    pytest.skip(f"multi-host tests need network namespaces: {_why}", allow_module_level=True)

MAX_TOKENS = 12
QUESTION = f"{IMAGE_TOKEN} What is this?"


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return str(create_tiny_model("llava", tmp_path_factory.mktemp("auth") / "llava"))


@pytest.fixture(scope="module")
def image_expected(llava_dir):
    llm = LLM(llava_dir, kv_cache_memory_gb=0.05, dtype="float32")
    try:
        tok = llm.get_tokenizer()
        text = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok.encode(text, add_special_tokens=False)
        out = llm.generate({"prompt_token_ids": ids, "multi_modal_data": {"image": [png(3)]}},
                           SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0]
        return out.outputs[0].text
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def dep(llava_dir, tmp_path_factory):
    from epd.cluster_auth import generate_keys

    keys = tmp_path_factory.mktemp("auth") / "keys"
    generate_keys(keys)
    cluster = Cluster(tmp_path_factory.mktemp("auth-logs"))
    try:
        d = Deployment(cluster, llava_dir, str(keys), "e:1,p:1,d:1")
        d.start_serve()
        for host, role, inst in (("enc", "encode", "encode-0"), ("pre", "prefill", "prefill-0"),
                                 ("dec", "decode", "decode-0")):
            d.start_worker(host, role, inst)
        cluster.add_host("evil")
        d.wait_healthy()
        yield d
    finally:
        cluster.close()


def _ask(dep: Deployment, seed: int = 3) -> str:
    def call() -> str:
        from openai import OpenAI

        client = OpenAI(base_url=dep.url + "/v1", api_key="none", max_retries=0, timeout=300)
        before, _, after = QUESTION.partition(IMAGE_TOKEN)
        parts = [{"type": "image_url", "image_url": {"url": data_url(png(seed))}}, {"type": "text", "text": after}]
        r = client.chat.completions.create(model=dep.model, messages=[{"role": "user", "content": parts}],
                                           max_tokens=MAX_TOKENS, temperature=0)
        return r.choices[0].message.content

    return dep.c.run_in("api", call)


def _cmd_endpoints(dep: Deployment) -> dict[str, str]:
    """Each worker's command endpoint, from the line it prints when it starts."""
    out = {}
    for inst in dep.workers:
        m = re.search(r"commands on (tcp://\S+?),? ", dep.c.log(inst))
        assert m, dep.c.log(inst)
        out[inst] = m.group(1)
    return out


def _hostile_messages() -> list:
    item = MediaItem("image", "f" * 64, {"pixel_values": torch.zeros(3, 4, 4)}, 1)
    return [WorkerReady("decode", "evil-0", 4242, "tcp://10.77.0.99:1", b"", []),
            WorkerReady("encode", "encode-0", 4243, "tcp://10.77.0.99:2", b"", []),
            Abort("cmpl-anything"), Shutdown(), EncodeRequest("evil-req", [item]),
            KVEvents("prefill-0", 1, [b"\0" * 16] * 4, [], True)]


def _attack(endpoints: list[str], keys_dir: str | None) -> None:
    """From host ``evil``: push every hostile message to every endpoint, without keys
    (plain) and with CURVE keys that are not the cluster's."""
    from epd.cluster_auth import MEMBER, generate_keys, load_keys

    ctx = zmq.Context()
    try:
        socks = []
        for ep in endpoints:
            plain = ctx.socket(zmq.PUSH)
            plain.connect(ep)
            socks.append(plain)
            if keys_dir is not None:
                generate_keys(keys_dir, force=True)
                other = load_keys(keys_dir, MEMBER)
                curve = ctx.socket(zmq.PUSH)
                other.client(curve)  # a CURVE client, but not a member: ZAP refuses it
                curve.connect(ep)
                socks.append(curve)
        time.sleep(1.0)
        for s in socks:
            for msg in _hostile_messages():
                try:
                    s.send(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection was ever admitted: nothing can be queued
        time.sleep(1.0)
    finally:
        ctx.destroy(linger=0)


def test_image_parity_across_hosts(dep, image_expected):
    assert _ask(dep) == image_expected


def test_a_peer_without_the_keys_changes_nothing(dep, image_expected, tmp_path):
    before_workers = dep.stats()
    def enc_metrics() -> str:
        return dep.c.run_in("api", httpx.get, f"http://{dep.c.addr('enc')}:9100/metrics", timeout=30).text

    queries = metric_sum(enc_metrics(), "epd_encoder_cache_queries_total")
    result: dict = {}
    # A stream is in flight while the attack runs: an Abort that got in would end it.
    t = threading.Thread(target=lambda: result.setdefault("text", _ask(dep, seed=5)))
    t.start()
    endpoints = [dep.router, *_cmd_endpoints(dep).values()]
    dep.c.run_in("evil", _attack, endpoints, str(tmp_path / "other-keys"))
    t.join(300)
    assert "text" in result  # completed: no Abort or Shutdown reached a worker
    after = dep.stats()
    assert set(after) == set(before_workers) == {"encode-0", "prefill-0", "decode-0"}
    assert all("unresponsive" not in s for s in after.values())  # nobody was shut down
    # Only the real request's one image was looked up: no EncodeRequest got in.
    assert metric_sum(enc_metrics(), "epd_encoder_cache_queries_total") == queries + 1
    assert _ask(dep) == image_expected
    for inst in dep.workers:  # no hostile byte reached a message decoder
        assert "malformed" not in dep.c.log(inst) and "ignores" not in dep.c.log(inst)


def _member_commands(endpoints: list[str], keys_dir: str) -> None:
    """From host ``evil``, with the cluster's member key (what any worker's host holds):
    push commands to every worker's command socket, naming the worker's own server key."""
    from epd.cluster_auth import MEMBER, load_keys

    member = load_keys(keys_dir, MEMBER)
    ctx = zmq.Context()
    try:
        socks = []
        for ep in endpoints:
            s = ctx.socket(zmq.PUSH)
            member.client(s)
            s.curve_serverkey = member.public  # a worker's command socket serves with the member key
            s.connect(ep)
            socks.append(s)
        time.sleep(1.0)
        for s in socks:
            for msg in (Registered("decode-0", 99), PeerInfo("evil-0", b"\0" * 64, [], None, 1),
                        Abort("cmpl-anything"), Shutdown()):
                try:
                    s.send(encode(msg), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # no connection was admitted: nothing can be queued
        time.sleep(2.0)
    finally:
        ctx.destroy(linger=0)


def test_the_member_key_commands_no_worker(dep, image_expected):
    """Issue 34 item 11: only the router's key opens a worker's command socket. A member
    key holder's Shutdown / PeerInfo / Registered / Abort reach no worker (a stream in
    flight completes, every worker stays), and every worker counts the refusals."""
    def denied(host: str) -> float:
        text = dep.c.run_in("api", httpx.get, f"http://{dep.c.addr(host)}:9100/metrics", timeout=30).text
        return metric_sum(text, "epd_auth_denied_total")

    hosts = {inst: host for inst, (host, _) in dep.workers.items() if inst in ("encode-0", "prefill-0", "decode-0")}
    before = {inst: denied(host) for inst, host in hosts.items()}
    result: dict = {}
    t = threading.Thread(target=lambda: result.setdefault("text", _ask(dep, seed=6)))
    t.start()
    endpoints = _cmd_endpoints(dep)
    dep.c.run_in("evil", _member_commands, [endpoints[i] for i in hosts], dep.keys)
    t.join(300)
    assert "text" in result  # completed: no Abort or Shutdown reached a worker
    assert set(dep.stats()) >= set(hosts)
    assert all("unresponsive" not in s for s in dep.stats().values())
    for inst, host in hosts.items():
        assert denied(host) > before[inst], inst
        assert "refused a CURVE client" in dep.c.log(inst), inst
    assert _ask(dep) == image_expected


def test_a_second_registration_of_a_live_instance_id_is_refused(dep):
    """A member (it holds the keys) claims prefill-0's id from another process: refused,
    and prefill-0 keeps serving."""
    from epd.cluster_auth import MEMBER, load_keys

    keys = load_keys(dep.keys, MEMBER)
    evil = dep.c.addr("evil")

    def claim() -> object:
        ctx = zmq.Context()
        try:
            pull = ctx.socket(zmq.PULL)
            keys.server(pull)
            auth = keys.start_authenticator(ctx)
            port = pull.bind_to_random_port(f"tcp://{evil}")
            push = ctx.socket(zmq.PUSH)
            keys.client(push)
            push.connect(dep.router)
            push.send(encode(WorkerReady("prefill", "prefill-0", 777, f"tcp://{evil}:{port}", b"", [])))
            if not pull.poll(10_000):
                return None
            answer = decode(pull.recv())
            auth.stop()
            return answer
        finally:
            ctx.destroy(linger=0)

    answer = dep.c.run_in("evil", claim)
    assert isinstance(answer, RegistrationRefused) and "live worker" in answer.reason, answer
    assert not isinstance(answer, Registered)
    assert set(dep.stats()) == {"encode-0", "prefill-0", "decode-0"}


def test_a_worker_serving_another_model_is_refused_and_exits(dep, tmp_path):
    """A member started on another checkpoint than `epd serve`'s is refused for good: it
    exits 1 naming --model, and never joins (it would answer with the wrong weights)."""
    other = str(create_tiny_model("llama", tmp_path / "llama"))
    dep.model, llava = other, dep.model
    try:
        dep.start_worker("evil", "decode", "decode-9")
    finally:
        dep.model = llava
    assert dep.workers["decode-9"][1].wait(180) == 1
    assert "another model" in dep.c.log("decode-9") and "--model" in dep.c.log("decode-9")
    assert "decode-9" not in dep.registered()


def test_binding_beyond_loopback_without_keys_refuses_to_start(tmp_path):
    env = {k: v for k, v in __import__("os").environ.items() if k != "EPD_CLUSTER_KEYS"}
    serve = subprocess.run([sys.executable, "-m", "epd.cli", "serve", "--router-host", "0.0.0.0", "--port", "0"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert serve.returncode == 2 and "epd keys generate" in serve.stderr and "--cluster-keys" in serve.stderr
    worker = subprocess.run([sys.executable, "-m", "epd.cli", "worker", "--role", "decode", "--instance-id", "d",
                             "--router", "tcp://10.77.0.1:5557", "--advertise-host", "10.77.0.5"],
                            capture_output=True, text=True, env=env, timeout=120)
    assert worker.returncode == 2 and "epd keys generate" in worker.stderr
