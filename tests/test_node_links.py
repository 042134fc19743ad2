"""The links between the nodes of a multi-node server are closed to strangers (actors/node_auth.py, nodes.py,
transport.py): the nodes' key file, CurveZMQ on the plans and the nodes' link, rogue peers (no key, a wrong key,
garbage, a forged NodeDown) refused and counted, malformed frames from a node dropped, plans numbered so a replay is
dropped and a gap ends the rank. The two-node server itself: tests/test_tensor_parallel.py."""
from __future__ import annotations

import logging
import socket
import time

import msgspec
import pytest
import zmq

from radixserve.actors.node_auth import NodeKeys, node_keys
from radixserve.actors.nodes import NodeLink
from radixserve.actors.transport import Endpoints, PlanLost, PlanSequence, Publisher
from radixserve.wire.codec import encoder
from radixserve.wire.messages import Heartbeat, NodeDown


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(check, timeout: float = 10.0, every=lambda: None) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        every()
        if check():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def keys() -> NodeKeys:
    return NodeKeys.from_secret(zmq.curve_keypair()[1])


def stranger(kind: str, ctx: zmq.Context, server_public: bytes) -> zmq.Socket:
    """A DEALER that does not hold the nodes' key: ``null`` (no Curve), ``wrong`` (its own pair)."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IDENTITY, b"node1")
    if kind == "wrong":
        public, secret = zmq.curve_keypair()
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, server_public
    return sock


# -- the key file ---------------------------------------------------------------------------------------------------

def test_node_zero_creates_a_private_key_and_the_others_read_the_same_one(tmp_path, caplog):
    path = tmp_path / "sub" / "dist-auth.key"
    with caplog.at_level(logging.WARNING):
        made = node_keys(path, create=True)
    assert (path.stat().st_mode & 0o777) == 0o600 and "copy it to every other node" in caplog.text
    assert node_keys(path, create=False, wait_s=0) == made  # a copy on another node: the same pair
    assert made.public == zmq.curve_public(made.secret) and "secret" not in repr(made)


def test_a_key_another_user_may_read_or_a_missing_or_broken_one_is_refused(tmp_path):
    path = tmp_path / "dist-auth.key"
    with pytest.raises(FileNotFoundError, match="copy node 0's --dist-auth-key-file"):
        node_keys(path, create=False, wait_s=0.1)
    node_keys(path, create=True)
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        node_keys(path, create=False)
    path.chmod(0o600)
    path.write_bytes(b"not a key\n")
    with pytest.raises(ValueError, match="does not hold a Curve secret key"):
        node_keys(path, create=False)


# -- the nodes' link ------------------------------------------------------------------------------------------------

def link_pair(keys: NodeKeys, first_contact_s: float = 30.0) -> tuple[NodeLink, NodeLink, str]:
    address = f"tcp://127.0.0.1:{free_port()}"
    node0 = NodeLink(address, 0, 2, silence_s=30.0, keys=keys, first_contact_s=first_contact_s)
    node1 = NodeLink(address, 1, 2, silence_s=30.0, keys=keys, first_contact_s=first_contact_s)
    return node0, node1, address


def test_nodes_with_the_key_pair_and_strangers_change_nothing_but_are_counted(keys, caplog):
    node0, node1, address = link_pair(keys)
    ctx = zmq.Context()
    rogues = []
    try:
        node1.say_ready({"runner1": {"pid": 1}}, {"tp": 2})
        assert wait_until(lambda: node0.poll() is None and node0.all_ready(), every=node1.poll)
        assert node0.ready == {1: {"runner1": {"pid": 1}}}
        forged = encoder().encode(NodeDown(1, "forged"))
        for kind in ("null", "wrong"):  # a forged NodeDown, with no key and with a key of its own
            rogue = stranger(kind, ctx, keys.public)
            rogue.connect(address)
            rogue.send(forged)
            rogues.append(rogue)
        host, port = address[len("tcp://"):].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as raw:  # garbage instead of a greeting
            raw.sendall(b"\x00garbage" * 64)
            time.sleep(0.2)
        with caplog.at_level(logging.WARNING):
            assert wait_until(lambda: node0.refused >= 3, every=lambda: (node0.poll(), node1.poll()))
        for _ in range(20):
            assert node0.poll() is None and node1.poll() is None
            time.sleep(0.02)
        assert node0.down is None and node0.dropped == 0 and "do not hold the multi-node key" in caplog.text
    finally:
        for rogue in rogues:
            rogue.close()
        ctx.term()
        node1.close()
        node0.close()


def test_a_malformed_or_misaddressed_frame_from_a_node_is_dropped_not_raised(keys, caplog):
    node0, node1, _ = link_pair(keys)
    try:
        assert wait_until(lambda: node0.poll() is None and 1 in node0._heard, every=node1.poll)
        with caplog.at_level(logging.WARNING):
            node1.sock.send(b"\xc1 not msgpack")
            node1.sock.send(msgspec.msgpack.encode({"type": "node_down", "node": "x"}))
            node1.sock.send(encoder().encode(NodeDown(5, "claims to be node 5")))
            node1.sock.send(encoder().encode(NodeDown(0, "claims to be node 0")))
            assert wait_until(lambda: node0.poll() is None and node0.dropped == 4)
        assert node0.down is None and caplog.text.count("on the nodes' link") == 4
        node1.say_down("a real one")  # the link still works
        assert wait_until(lambda: node0.poll() is not None)
        assert node0.down == "node 1 ended: a real one"
    finally:
        node1.close()
        node0.close()


def test_a_node_with_another_key_is_never_heard_and_both_sides_end(keys):
    address = f"tcp://127.0.0.1:{free_port()}"
    node0 = NodeLink(address, 0, 2, silence_s=30.0, keys=keys, first_contact_s=1.0)
    other = NodeKeys.from_secret(zmq.curve_keypair()[1])
    node1 = NodeLink(address, 1, 2, silence_s=30.0, keys=other, first_contact_s=1.0)
    try:
        assert wait_until(lambda: node0.poll() is not None and node1.poll() is not None)
        assert "not heard from in 1s" in node0.down and "--dist-auth-key-file" in node1.down
        assert node0.ready == {} and node0.refused >= 1
    finally:
        node1.close()
        node0.close()


# -- the plans --------------------------------------------------------------------------------------------------------

def test_only_key_holders_subscribe_to_the_plans_and_strangers_do_not_count(keys, tmp_path):
    endpoints = Endpoints(str(tmp_path), f"127.0.0.1:{free_port()}", keys)
    publisher = Publisher(endpoints.plans_bound(), keys)
    ctx = zmq.Context()
    subs = {}
    try:
        for kind in ("null", "wrong", "holder"):
            sock = ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            if kind == "wrong":
                public, secret = zmq.curve_keypair()
                sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, keys.public
            elif kind == "holder":
                keys.connect(sock)
            sock.connect(endpoints.plans_source(1))  # node 0's PORT+1, as another node reaches it
            subs[kind] = sock
        publisher.wait_for(1, 10)
        with pytest.raises(RuntimeError, match="only 1 of 2"):
            publisher.wait_for(2, 1)  # the strangers' subscriptions never arrive
        publisher.send(Heartbeat(0))
        assert subs["holder"].poll(5000) and subs["holder"].recv_multipart()[0] == (1).to_bytes(8, "big")
        assert not subs["null"].poll(300) and not subs["wrong"].poll(0)
        assert wait_until(lambda: publisher.guard.drain() >= 2)
    finally:
        for sock in subs.values():
            sock.close()
        ctx.term()
        publisher.close()


class FakeFrame(bytes):
    @property
    def bytes(self) -> bytes:
        return bytes(self)


def frames(seq: int) -> list[FakeFrame]:
    return [FakeFrame(seq.to_bytes(8, "big")), FakeFrame(b"plan")]


def test_a_replayed_plan_is_dropped_and_a_lost_one_ends_the_rank(caplog):
    plans = PlanSequence()
    assert plans.accept(frames(1)) and plans.accept(frames(2))
    with caplog.at_level(logging.WARNING):
        assert not plans.accept(frames(2)) and not plans.accept(frames(1))
    assert plans.replayed == 2 and "already run" in caplog.text
    assert plans.accept(frames(3))
    with pytest.raises(PlanLost, match=r"plan 6 arrived after plan 3: 2 plan\(s\) never reached"):
        plans.accept(frames(6))
    with pytest.raises(PlanLost, match="not \\[sequence number, plan\\]"):
        PlanSequence().accept([FakeFrame(b"plan")])


def test_one_machine_needs_no_key(tmp_path):
    """Without --nnodes the plans stay on ipc:// in the private runtime dir, with no Curve."""
    endpoints = Endpoints(str(tmp_path))
    assert endpoints.keys is None and endpoints.plans_bound() == [f"ipc://{tmp_path}/plans.sock"]
