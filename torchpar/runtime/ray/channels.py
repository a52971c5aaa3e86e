"""Direct channels between the host actors of one engine: stage messages (:mod:`torchpar.runtime.pipeline.transport`) go
from actor to actor over a TCP connection, not through Ray's object store.

A Ray actor call with a 256 KB argument costs the caller milliseconds (the object store's create, copy and
seal, then the task's way through Ray) and the receiver a fetch; a pipeline makes two such calls per
micro-batch and stage. Here a message is one pickle (protocol 5) whose arrays travel out of band as raw bytes:

    frame = u64 header length · u32 buffer count · u64 length of each buffer · header · buffers

The sender writes it with ``sendall`` (no copy of the arrays beyond the kernel's); the receiver reads each
buffer into a fresh ``bytearray`` and unpickles the arrays onto them (no copy either), then hands
``(key, payload)`` to the mailbox. Every actor listens on one port of its node's address (:class:`ChannelServer`,
started when the actors join into one JAX system) and connects to a peer at its first message
(:class:`PeerLinks`); each connection carries messages in order, and a lock per peer keeps concurrent senders'
frames whole. A peer that died makes the send raise (the step fails and the executor names the dead host).

A connection opens with the listener's random token, which only the engine's actors learn (through the driver,
over Ray): the listener unpickles nothing from a connection that did not present it.
"""

from __future__ import annotations

import hmac
import logging
import pickle
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchpar.runtime.pipeline.transport import MessageKey

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<QI")
TOKEN_BYTES = 32


class ChannelServer:
    """Accepts peers' connections and delivers every message read from them to ``on_message(key, payload)``.
    ``address``: ``(host, port, token)``, what a peer needs to connect."""

    def __init__(self, host: str, on_message: Callable[[MessageKey, object], None]):
        self._on_message = on_message
        self._token = secrets.token_bytes(TOKEN_BYTES)
        self._listener = socket.create_server((host, 0))
        self.address = (host, self._listener.getsockname()[1], self._token.hex())
        threading.Thread(target=self._accept, name="torchpar-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:  # closed
                return
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._read, args=(connection,), name="torchpar-channel-read", daemon=True).start()

    def _read(self, connection: socket.socket) -> None:
        with connection:
            try:
                if not hmac.compare_digest(bytes(_read_exactly(connection, TOKEN_BYTES)), self._token):
                    log.warning("torchpar: a connection to the stage channel without its token was closed")
                    return
            except ConnectionError:
                return
            while True:
                try:
                    head = _read_exactly(connection, _HEAD.size)
                except ConnectionError:
                    return  # the peer closed (or died): its sends fail on its side
                header_bytes, count = _HEAD.unpack(head)
                sizes = struct.unpack(f"<{count}Q", _read_exactly(connection, 8 * count)) if count else ()
                header = _read_exactly(connection, header_bytes)
                buffers = [_read_exactly(connection, size) for size in sizes]
                key, payload = pickle.loads(header, buffers=buffers)
                self._on_message(key, payload)

    def close(self) -> None:
        self._listener.close()


class PeerLinks:
    """This actor's outgoing connections, by peer rank (``addresses``: each peer's :attr:`ChannelServer.address`)."""

    def __init__(self, addresses: dict[int, tuple[str, int, str]]):
        self.addresses = dict(addresses)
        self._sockets: dict[int, socket.socket] = {}
        self._locks = {rank: threading.Lock() for rank in self.addresses}

    def __contains__(self, rank: int) -> bool:
        return rank in self.addresses

    def send(self, rank: int, key: MessageKey, payload: object) -> None:
        """One message to peer ``rank``, in order with this actor's earlier ones to it."""
        buffers: list[pickle.PickleBuffer] = []
        header = pickle.dumps((key, payload), protocol=5, buffer_callback=buffers.append)
        views = [b.raw() for b in buffers]
        head = _HEAD.pack(len(header), len(views)) + struct.pack(f"<{len(views)}Q", *(v.nbytes for v in views))
        with self._locks[rank]:
            connection = self._sockets.get(rank)
            if connection is None:
                host, port, token = self.addresses[rank]
                connection = socket.create_connection((host, port))
                connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                connection.sendall(bytes.fromhex(token))
                self._sockets[rank] = connection
            connection.sendall(head + header)
            for view in views:
                connection.sendall(view)

    def close(self) -> None:
        for connection in self._sockets.values():
            connection.close()
        self._sockets.clear()


def _read_exactly(connection: socket.socket, size: int) -> bytearray:
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = connection.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("the peer closed the channel")
        got += n
    return data
