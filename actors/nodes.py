"""The link between the launchers of a multi-node server (``--nnodes``): node 0 binds a ROUTER at
``--dist-init-addr``'s PORT+2, every other node connects a DEALER to it. Over it a node says when its ranks are
ready (NodeReady), that it is ending (NodeDown), and that it is alive (Heartbeat, every HEARTBEAT_S). A node that
ends, or that falls silent for longer than 10 s (``--dist-timeout`` if shorter), ends every other node: a rank dying
anywhere takes the whole server down on every machine, and no rank waits in a collective for a dead peer.

The link speaks CurveZMQ with the nodes' shared key (actors/node_auth.py): a peer without it completes no
handshake and is only counted. What an authenticated peer sends is still checked: a frame that does not decode, or
that names a node other than the one it came from, is dropped, counted and logged -- never raised into the
launcher.
"""
from __future__ import annotations

import logging
import time

import msgspec
import zmq

from radixserve.actors.node_auth import NodeKeys, PeerGuard
from radixserve.wire.codec import decoder, encoder
from radixserve.wire.messages import Heartbeat, NodeDown, NodeInbox, NodeReady

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
MAX_MESSAGE_BYTES = 2**20  # NodeReady, the largest, is a few KiB: a larger frame is dropped by libzmq
HWM = 1000  # messages queued per peer (a heartbeat every HEARTBEAT_S: minutes of them)


class NodeLink:
    def __init__(self, address: str, node_rank: int, nnodes: int, silence_s: float, keys: NodeKeys,
                 first_contact_s: float) -> None:
        """``first_contact_s``: how long after this link was made every peer (node 0 for the others, every other
        node for node 0) must first be heard from; a peer silent that long is taken for one that cannot join."""
        self.node, self.nnodes, self.silence_s = node_rank, nnodes, silence_s
        self.first_contact_s, self._made = first_contact_s, time.monotonic()
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER if node_rank == 0 else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a last NodeDown still leaves
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.guard: PeerGuard | None = None
        if node_rank == 0:
            self.guard = PeerGuard(self.ctx, keys, "the nodes' link")
            keys.serve(self.sock)
            self.guard.watch(self.sock)
            self.sock.bind(address)
        else:
            self.sock.setsockopt(zmq.IDENTITY, f"node{node_rank}".encode())
            keys.connect(self.sock)
            self.sock.connect(address)
        self.dropped = 0  # malformed or misaddressed messages from authenticated peers
        self._enc, self._dec = encoder(), decoder(NodeInbox)
        self.ready: dict[int, dict[str, dict]] = {}  # node -> its actors' Ready infos
        self.configs: dict[int, dict] = {}  # node -> the settings it was started with
        self._peers: dict[int, bytes] = {}  # node 0: node -> its socket identity
        self._heard: dict[int, float] = {}  # node -> when it was last heard from
        self._sent = 0.0
        self.down: str | None = None  # why another node ended (or fell silent)

    def _send(self, msg, node: int | None = None) -> None:
        data = self._enc.encode(msg)
        if self.node != 0:
            self.sock.send(data, zmq.NOBLOCK)
            return
        for peer, identity in self._peers.items():
            if node is None or peer == node:
                self.sock.send_multipart([identity, data], zmq.NOBLOCK)

    def poll(self) -> str | None:
        """Take what arrived and send a heartbeat when due; why the server must end, or None."""
        while self.sock.poll(0):
            msg = self._take(self.sock.recv_multipart())
            if msg is None:
                continue
            self._heard[msg.node] = time.monotonic()
            if isinstance(msg, NodeReady):
                self.ready[msg.node] = msg.actors
                self.configs[msg.node] = msg.config
            elif isinstance(msg, NodeDown) and self.down is None:
                self.down = f"node {msg.node} ended: {msg.reason}"
        if self.guard is not None:
            self.guard.drain()  # count and log refused peers
        now = time.monotonic()
        if now - self._sent >= HEARTBEAT_S:
            self._sent = now
            self._send_now(Heartbeat(self.node))
        for node, heard in self._heard.items():
            if self.down is None and now - heard > self.silence_s:
                self.down = f"node {node} fell silent for {self.silence_s:.0f}s"
        peers = range(1, self.nnodes) if self.node == 0 else (0,)
        never = [node for node in peers if node not in self._heard]
        if self.down is None and never and now - self._made > self.first_contact_s:
            self.down = (f"node(s) {', '.join(map(str, never))} not heard from in {self.first_contact_s:.0f}s: "
                         "start every node within --dist-timeout, with the same --dist-init-addr and the same "
                         "--dist-auth-key-file (a node with another key is refused, and counted in node 0's log)")
        return self.down

    def _take(self, frames: list[bytes]) -> NodeReady | NodeDown | Heartbeat | None:
        """The message in ``frames``, or None (dropped, counted, logged) if it is malformed or claims a node it
        did not come from. Node 0 learns each node's socket identity from its first message."""
        why = None
        try:
            msg = self._dec.decode(frames[-1])
        except msgspec.DecodeError as exc:
            msg, why = None, f"a frame that is not a node message ({exc})"
        if msg is not None:
            if self.node == 0:
                expected = frames[0] if len(frames) == 2 else None
                if expected != f"node{msg.node}".encode() or not 0 < msg.node < self.nnodes:
                    why = f"a message for node {msg.node} from {expected!r}"
                else:
                    self._peers[msg.node] = frames[0]
            elif len(frames) != 1 or msg.node != 0:
                why = f"a message claiming node {msg.node}: only node 0 talks to this node"
        if why is None:
            return msg
        self.dropped += 1
        log.warning("dropped %s on the nodes' link (%d dropped in all)", why, self.dropped)
        return None

    @property
    def refused(self) -> int:
        """Peers without the nodes' key refused so far (node 0)."""
        return self.guard.drain() if self.guard is not None else 0

    def all_ready(self) -> bool:
        """Node 0: every other node's ranks are up."""
        return len(self.ready) == self.nnodes - 1

    def say_ready(self, actors: dict[str, dict], config: dict) -> None:
        self._send_now(NodeReady(self.node, actors, config))

    def disagreement(self, config: dict) -> str | None:
        """Node 0: how a node that is ready was started differently from ``config`` (node 0's), or None."""
        for node, theirs in sorted(self.configs.items()):
            differ = [f"{k} {config[k]} here, {theirs.get(k)} there" for k in config if theirs.get(k) != config[k]]
            if differ:
                return f"node {node} was started with other settings: {'; '.join(differ)}"
        return None

    def say_down(self, reason: str) -> None:
        self._send_now(NodeDown(self.node, reason))

    def _send_now(self, msg) -> None:
        try:
            self._send(msg)
        except zmq.Again:  # the peer is gone: its own watch ends it
            pass

    def close(self) -> None:
        if self.guard is not None:
            self.guard.close()
        self.sock.close()
        self.ctx.term()
