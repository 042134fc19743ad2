"""The link between the launchers of a multi-node server (``--nnodes``): node 0 binds a ROUTER at
``--dist-init-addr``'s PORT+2, every other node connects a DEALER to it. Over it a node says when its ranks are
ready (NodeReady), that it is ending (NodeDown), and that it is alive (Heartbeat, every HEARTBEAT_S). A node that
ends, or that falls silent for longer than 10 s (``--dist-timeout`` if shorter), ends every other node: a rank dying
anywhere takes the whole server down on every machine, and no rank waits in a collective for a dead peer.
"""
from __future__ import annotations

import time

import zmq

from radixserve.actors.messages import Heartbeat, NodeDown, NodeInbox, NodeReady
from radixserve.actors.wire import decoder, encoder

HEARTBEAT_S = 0.5


class NodeLink:
    def __init__(self, address: str, node_rank: int, nnodes: int, silence_s: float) -> None:
        self.node, self.nnodes, self.silence_s = node_rank, nnodes, silence_s
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER if node_rank == 0 else zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)  # a last NodeDown still leaves
        if node_rank == 0:
            self.sock.bind(address)
        else:
            self.sock.setsockopt(zmq.IDENTITY, f"node{node_rank}".encode())
            self.sock.connect(address)
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
            frames = self.sock.recv_multipart()
            msg = self._dec.decode(frames[-1])
            if self.node == 0:
                self._peers[msg.node] = frames[0]
            self._heard[msg.node] = time.monotonic()
            if isinstance(msg, NodeReady):
                self.ready[msg.node] = msg.actors
                self.configs[msg.node] = msg.config
            elif isinstance(msg, NodeDown) and self.down is None:
                self.down = f"node {msg.node} ended: {msg.reason}"
        now = time.monotonic()
        if now - self._sent >= HEARTBEAT_S:
            self._sent = now
            self._send_now(Heartbeat(self.node))
        for node, heard in self._heard.items():
            if self.down is None and now - heard > self.silence_s:
                self.down = f"node {node} fell silent for {self.silence_s:.0f}s"
        return self.down

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
        self.sock.close()
        self.ctx.term()
