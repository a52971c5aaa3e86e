"""Direct stage channels between host actors (:mod:`torchpar.runtime.ray.channels`), in one process: messages arrive
whole, in order, with their arrays; a connection without the listener's token delivers nothing."""

from __future__ import annotations

import pickle
import queue
import socket

import numpy as np

from torchpar.runtime.ray.channels import ChannelServer, PeerLinks


def test_messages_arrive_in_order_with_their_arrays():
    inbox: queue.Queue = queue.Queue()
    server = ChannelServer("127.0.0.1", lambda key, payload: inbox.put((key, payload)))
    links = PeerLinks({1: server.address})
    try:
        big = np.arange(300_000, dtype=np.float32).reshape(300, 1000)
        strided = big[:, ::2]  # not contiguous: pickled in band
        for step in range(3):
            links.send(1, ("act", step), ("pieces", {"x": (big.shape, big.dtype, [(((0, 300), (0, 1000)), big + step)]),
                                                     "y": strided}))
        for step in range(3):
            key, (form, content) = inbox.get(timeout=10)
            assert key == ("act", step) and form == "pieces"
            np.testing.assert_array_equal(content["x"][2][0][1], big + step)
            np.testing.assert_array_equal(content["y"], strided)
    finally:
        links.close()
        server.close()


def test_a_connection_without_the_token_delivers_nothing():
    inbox: queue.Queue = queue.Queue()
    server = ChannelServer("127.0.0.1", lambda key, payload: inbox.put((key, payload)))
    host, port, _ = server.address
    try:
        header = pickle.dumps(("key", "payload"))
        with socket.create_connection((host, port)) as intruder:
            intruder.sendall(b"\0" * 32 + len(header).to_bytes(8, "little") + (0).to_bytes(4, "little") + header)
        links = PeerLinks({1: server.address})
        links.send(1, "real", "message")
        assert inbox.get(timeout=10) == ("real", "message")
        assert inbox.empty()
        links.close()
    finally:
        server.close()
