"""Who may talk on the links between the nodes of a multi-node server (``--nnodes``): CurveZMQ with one shared key.

Every node holds the same Curve secret key, in ``--dist-auth-key-file`` (default ``$RADIXSERVE_CACHE/dist-auth.key``):
node 0 creates it when absent, and the operator copies it to the other nodes. From it every node derives one key
pair, and every socket on a node link speaks CurveZMQ with it: node 0's sockets as the Curve server (its public key
is what the others must know), the others' as clients with the same pair. A ZAP handler on node 0 admits exactly
that client key, so a peer without the file completes no handshake: it can neither subscribe to the plans (every
prompt's token ids) nor send the launcher a NodeDown. Traffic is encrypted, and Curve's nonces refuse a replayed
message within a session.

    keys = node_keys(path, create=node_rank == 0)
    guard = PeerGuard(ctx, keys, "the plans")     # node 0: before binding; counts and logs refused peers
    keys.serve(sock); sock.bind(...)              # node 0
    keys.connect(sock); sock.connect(...)         # every other node (and node 0's own subscribers)
    guard.drain()                                 # from the socket's owner, now and then

The key file is a secret: it must belong to the server's user and be unreadable by others (like an ssh key);
anything else is refused with the chmod to run.
"""
from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

log = logging.getLogger(__name__)

KEY_WAIT_S = 60.0  # another node waits this long for the copied key file (its log says what to copy)
# a connection accepted and gone without a handshake is a refused peer: a wrong key, no Curve, or garbage that never
# made a greeting (a failed handshake is reported by an error code, not by the connection, so the pair is counted)
EVENTS = zmq.EVENT_ACCEPTED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
LOG_EVERY_S = 10.0  # a flood of refused peers is one log line per this many seconds


@dataclass(frozen=True)
class NodeKeys:
    """The key pair every node derives from the shared secret (Z85 text, 40 characters each)."""

    secret: bytes = field(repr=False)
    public: bytes

    @classmethod
    def from_secret(cls, secret: bytes) -> NodeKeys:
        return cls(secret, zmq.curve_public(secret))

    def serve(self, sock: zmq.Socket) -> None:
        """``sock`` accepts only Curve peers (who must also pass node 0's PeerGuard). Before bind."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """``sock`` reaches a server set up by ``serve`` and proves it holds the secret. Before connect."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_serverkey = self.public


def node_keys(path: Path, create: bool, wait_s: float = KEY_WAIT_S) -> NodeKeys:
    """The keys in ``path``. ``create`` (node 0): make the file when absent, mode 0600, and log how to copy it.
    Otherwise wait up to ``wait_s`` for the operator to copy it there; FileNotFoundError after that.
    PermissionError if the file is not the server user's own or others may read or write it."""
    if not path.exists() and create:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        _, secret = zmq.curve_keypair()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)  # never readable by others, not even briefly
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
        log.warning("created the multi-node key %s: copy it to every other node before starting it there, e.g. "
                    "`scp %s NODE:%s` (then `chmod 600` it), or pass --dist-auth-key-file where you put it",
                    path, path, path)
    deadline = time.monotonic() + wait_s
    if not path.exists():
        log.warning("waiting up to %.0fs for the multi-node key %s: copy node 0's key file (created there on its "
                    "first start) to this path, mode 0600", wait_s, path)
    while not path.exists():
        if time.monotonic() > deadline:
            raise FileNotFoundError(f"no multi-node key at {path}: copy node 0's --dist-auth-key-file (created on "
                                    f"node 0's first start) to this path with mode 0600, or pass "
                                    "--dist-auth-key-file where it is")
        time.sleep(0.2)
    _check_private(path)
    secret = path.read_bytes().strip()
    try:
        return NodeKeys.from_secret(secret)
    except (ValueError, zmq.ZMQError) as exc:
        raise ValueError(f"{path} does not hold a Curve secret key (40 Z85 characters): {exc}; delete it on node "
                         "0 to have a new one made, then copy that one to the other nodes") from None


def _check_private(path: Path) -> None:
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"the multi-node key {path} belongs to uid {info.st_uid}, not to this user "
                              f"({os.getuid()}): whoever owns it can join the server's nodes")
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise PermissionError(f"the multi-node key {path} can be read or written by other users (mode "
                              f"{stat.S_IMODE(info.st_mode):o}): run `chmod 600 {path}`")


class PeerGuard:
    """Node 0's side of Curve-served sockets: the ZAP handler admitting only the nodes' key, and a count of the
    peers refused (a wrong key, no Curve, garbage instead of a handshake: accepted, then gone without a handshake;
    one that says nothing is dropped by libzmq's handshake timeout, 30 s), logged. Create it before binding."""

    def __init__(self, ctx: zmq.Context, keys: NodeKeys, what: str) -> None:
        self.what, self.keys = what, keys
        self.refused = 0
        self._logged, self._last_log = 0, 0.0
        self.auth = ThreadAuthenticator(ctx, log=logging.getLogger(f"{__name__}.zap"))
        self.auth.start()
        self.auth.configure_curve_callback("*", credentials_provider=self)
        self._monitors: list[zmq.Socket] = []
        self._shaking: set[tuple[int, int]] = set()  # (monitor, fd) of connections accepted, not yet authenticated

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP's question (Z85 key): is this peer one of the nodes?"""
        return client_key == self.keys.public

    def watch(self, sock: zmq.Socket) -> None:
        """Count the refused peers of ``sock`` (set up with ``keys.serve``)."""
        self._monitors.append(sock.get_monitor_socket(EVENTS))

    def drain(self) -> int:
        """Take the handshake failures reported so far (non-blocking); log them at most every LOG_EVERY_S.
        Returns the total refused."""
        for i, mon in enumerate(self._monitors):
            while mon.poll(0):
                event = recv_monitor_message(mon)
                conn = (i, event["value"])  # the connection's fd
                if event["event"] == zmq.EVENT_ACCEPTED:
                    self._shaking.add(conn)
                elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self._shaking.discard(conn)
                elif event["event"] == zmq.EVENT_DISCONNECTED and conn in self._shaking:
                    self._shaking.discard(conn)
                    self.refused += 1
        now = time.monotonic()
        if self.refused > self._logged and now - self._last_log >= LOG_EVERY_S:
            log.warning("refused %d peer(s) on %s that do not hold the multi-node key (%d in all): only nodes "
                        "started with the same --dist-auth-key-file may connect", self.refused - self._logged,
                        self.what, self.refused)
            self._logged, self._last_log = self.refused, now
        return self.refused

    def close(self) -> None:
        for mon in self._monitors:
            mon.close(0)
        self.auth.stop()
