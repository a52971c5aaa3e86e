"""Sharded checkpoints on the Ray runtime: each host actor writes the shards of its own devices (the index records
which process wrote each file), and the checkpoint loads into another method on the actors and into one device of
the local runtime, each process reading the slices its devices hold."""

from __future__ import annotations

import os

import numpy as np

from tests.api import checkpoint_helpers as run
from tests.runtime.ray_helpers import ray_cluster
from torchpar.checkpoint import load, read_index


def test_host_actors_write_their_own_shards_and_the_checkpoint_moves_between_runtimes(tmp_path):
    path = tmp_path / "ckpt"
    with ray_cluster(num_hosts=2, devices_per_host=2):
        engine, _, scheduler = run.compile("zero3")  # a (1, 4) mesh over both hosts: each holds 2 of the 4 shards of every tensor
        with engine:
            run.train(engine, scheduler, range(3))
            engine.save(path, scheduler=scheduler)
            # loaded back, each actor reads its own devices' slices: half of the (all sharded) state
            loaded = load(engine._training_state(), path, scheduler=scheduler)
            total = sum(info["bytes"] for info in loaded["files"].values())
            assert len(loaded["bytes_read"]) == 2 and all(b < 0.55 * total for b in loaded["bytes_read"]), loaded["bytes_read"]
            expected = run.train(engine, scheduler, range(3, 5))
            actor_pids = {w["pid"] for w in engine.describe_workers()}
        index = read_index(path)
        writers = {name: info["pid"] for name, info in index["files"].items()}
        assert len(writers) == 4 and set(writers.values()) == actor_pids and len(actor_pids) == 2
        assert os.getpid() not in actor_pids  # the driver wrote nothing: no process holds (or wrote) it all
        for pid in actor_pids:
            assert sum(p == pid for p in writers.values()) == 2, writers  # each host its two devices' files

        engine, _, scheduler = run.compile("data_parallel")  # replicated on both hosts: each reads both hosts' files
        with engine:
            engine.load(path, scheduler=scheduler)
            np.testing.assert_allclose(run.train(engine, scheduler, range(3, 5)), expected, rtol=1e-5, atol=0)

    engine, _, scheduler = run.compile("one_device")  # the local runtime
    with engine:
        engine.load(path, scheduler=scheduler)
        np.testing.assert_allclose(run.train(engine, scheduler, range(3, 5)), expected, rtol=1e-5, atol=0)
