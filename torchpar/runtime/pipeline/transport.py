"""Moving values between pipeline stages: a mailbox per process and a transport over it.

A stage runs on the processes that own its devices (one in the local runtime; one or several host
actors in the Ray runtime). Sending a dict of arrays from stage ``a`` to stage ``b`` means: every process
of ``a`` sends exactly one message to every process of ``b``, and every process of ``b`` waits for one
message from every process of ``a``. A message holds either

- ``arrays``: the values already on their target shardings (``jax.device_put`` device to device), when
  sender and receiver are this one process and both layouts are fully addressable in it — the only
  case in the local runtime; or
- ``pieces``: for each value, the host slices the receiving process needs for its own devices. Each
  distinct shard of the source layout is sent by one owner (the receiving process itself if it holds a
  replica, else the lowest-ranked process holding it), so pieces never overlap and nothing is sent
  twice. The receiver assembles each of its devices' slices and builds the global array
  (``jax.make_array_from_single_device_arrays``).

Both sides compute the same deterministic split from the shardings alone, so no negotiation is needed.
Receives block with a deadline; :meth:`Mailbox.abort` wakes every waiter with the failure that ended
the step, so one stage's error does not leave the others waiting out their timeout.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import jax
import numpy as np

from torchpar.runtime.arrays import Index, extent, fitting, intersect, normalize, relative
from torchpar.runtime.pipeline.timeline import StageClock


class TransportError(RuntimeError):
    """A receive timed out or the step was aborted while waiting."""


@dataclass(frozen=True)
class MessageKey:
    """One message: in which step, what (``"act"``, ``"grad"``, ``"tied"``), between which stages, for which
    micro-batch, from which process rank."""

    step: int
    kind: str
    src_stage: int
    dst_stage: int
    micro_batch: int
    sender: int

    def describe(self) -> str:
        what = {"act": "activations", "grad": "activation gradients", "tied": "tied-parameter gradients"}
        return (
            f"the {what.get(self.kind, self.kind)} of micro-batch {self.micro_batch} from stage {self.src_stage} "
            f"(process {self.sender}) for stage {self.dst_stage}"
        )


Pieces: TypeAlias = list[tuple[Index, np.ndarray]]
"""Host slices of one value: each slice's index in the global array and its data."""
Message: TypeAlias = (
    tuple[Literal["arrays"], dict[str, jax.Array]]
    | tuple[Literal["pieces"], dict[str, tuple[tuple[int, ...], np.dtype, Pieces]]]
)
"""What one process sends another (see the module docstring): ``("arrays", {name: array})`` or
``("pieces", {name: (shape, dtype, pieces)})``."""


class Mailbox:
    """Messages delivered to one process, taken by key; waits are bounded."""

    def __init__(self) -> None:
        self._messages: dict[MessageKey, object] = {}
        self._cv = threading.Condition()
        self._aborted: BaseException | None = None

    def put(self, key: MessageKey, payload: object) -> None:
        with self._cv:
            self._messages[key] = payload
            self._cv.notify_all()

    def take(self, key: MessageKey, timeout_s: float, where: str) -> object:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while key not in self._messages:
                if self._aborted is not None:
                    raise TransportError(
                        f"{where}: stopped waiting for {key.describe()}: another stage failed ({self._aborted})"
                    )
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"{where} waited {timeout_s:.0f}s for {key.describe()}")
                self._cv.wait(left)
            return self._messages.pop(key)

    def abort(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (until :meth:`reset`)."""
        with self._cv:
            self._aborted = error
            self._cv.notify_all()

    def begin_step(self, step: int) -> None:
        """Forget a previous abort and messages of earlier steps. Messages of ``step`` itself are kept: a peer
        may start the step, and send, before this process does."""
        with self._cv:
            self._messages = {k: v for k, v in self._messages.items() if k.step >= step}
            self._aborted = None


Deliver = Callable[[int, MessageKey, Message], None]
"""``deliver(rank, key, payload)``: hand a message to another process's mailbox."""


class Transport:
    """Sends and receives stage values for the process of rank ``rank`` (see the module docstring).

    ``ranks_of_stage`` lists the process ranks of every stage (ascending); ``deliver`` reaches other
    processes (``None`` when everything runs in this one)."""

    def __init__(
        self,
        rank: int,
        ranks_of_stage: Mapping[int, tuple[int, ...]],
        mailbox: Mailbox,
        deliver: Deliver | None,
        timeout_s: float,
    ):
        self.rank = rank
        self.ranks_of_stage = {s: tuple(r) for s, r in ranks_of_stage.items()}
        self.mailbox = mailbox
        self._deliver = deliver
        self.timeout_s = timeout_s
        self.step = 0

    def begin_step(self, step: int) -> None:
        """Messages from now on belong to ``step`` (every process numbers its steps alike)."""
        self.step = step
        self.mailbox.begin_step(step)

    def send(
        self,
        kind: str,
        src: int,
        dst: int,
        micro_batch: int,
        values: Mapping[str, jax.Array],
        targets: Mapping[str, jax.sharding.Sharding],
        clock: StageClock | None = None,
    ) -> None:
        """Send ``values`` (arrays of stage ``src``) to stage ``dst``, which holds each as ``targets[name]``;
        ``clock`` records the time it took (``send``)."""
        begin = time.time()
        targets = {n: fitting(targets[n], v.shape) for n, v in values.items()}  # uneven splits: left whole
        for receiver in self.ranks_of_stage[dst]:
            key = MessageKey(self.step, kind, src, dst, micro_batch, self.rank)
            local = (
                receiver == self.rank
                and all(v.is_fully_addressable for v in values.values())
                and all(targets[n].is_fully_addressable for n in values)
            )
            if local:
                payload: Message = ("arrays", {n: jax.device_put(v, targets[n]) for n, v in values.items()})
            else:
                payload = (
                    "pieces",
                    {
                        n: (tuple(v.shape), v.dtype, _pieces_for(v, targets[n], receiver, self.rank))
                        for n, v in values.items()
                    },
                )
            if receiver == self.rank:
                self.mailbox.put(key, payload)
            else:
                if self._deliver is None:
                    raise RuntimeError(f"stage {dst} lives on process {receiver}, but this runtime has no peers")
                self._deliver(receiver, key, payload)
        if clock is not None:
            clock.span("send", micro_batch, begin, time.time())

    def receive(
        self,
        kind: str,
        src: int,
        dst: int,
        micro_batch: int,
        targets: Mapping[str, jax.sharding.Sharding],
        clock: StageClock | None = None,
    ) -> dict[str, jax.Array]:
        """The values stage ``src`` sent to stage ``dst`` for ``micro_batch``, laid out as ``targets``;
        ``clock`` records the time spent waiting for the message (``recv_wait``) and building the arrays
        (``recv_copy``)."""
        wait = time.time()
        where = f"stage {dst} (process {self.rank})"
        arrays: dict[str, jax.Array] = {}
        pieces: dict[str, Pieces] = {}
        meta: dict[str, tuple[tuple[int, ...], np.dtype]] = {}
        for sender in self.ranks_of_stage[src]:
            message = cast(  # what the sender's Transport.send put together
                Message,
                self.mailbox.take(MessageKey(self.step, kind, src, dst, micro_batch, sender), self.timeout_s, where),
            )
            if message[0] == "arrays":
                arrays.update(message[1])
                continue
            for name, (shape, dtype, parts) in message[1].items():
                meta[name] = (shape, dtype)
                pieces.setdefault(name, []).extend(parts)
        copy = time.time()
        for name, (shape, dtype) in meta.items():
            arrays[name] = _assemble_global(shape, dtype, fitting(targets[name], shape), pieces[name], name)
        if clock is not None:
            clock.span("recv_wait", micro_batch, wait, copy)
            clock.span("recv_copy", micro_batch, copy, time.time())
        return arrays


def _pieces_for(value: jax.Array, target: jax.sharding.Sharding, receiver: int, rank: int) -> Pieces:
    """The slices of ``value`` that process ``rank`` owes process ``receiver``, for ``target``'s layout."""
    shape = value.shape
    needed = {
        normalize(index, shape)
        for device, index in target.devices_indices_map(shape).items()
        if device.process_index == receiver  # type: ignore[attr-defined]  # jaxlib has no stub of its Device
    }
    holders: dict[Index, set[int]] = {}
    for device, index in value.sharding.devices_indices_map(shape).items():
        holders.setdefault(normalize(index, shape), set()).add(
            device.process_index  # type: ignore[attr-defined]  # jaxlib has no stub of its Device
        )
    pieces: dict[Index, np.ndarray] = {}
    done: set[Index] = set()
    for shard in value.addressable_shards:
        region = normalize(shard.index, shape)
        owners = holders[region]
        owner = receiver if receiver in owners else min(owners)
        if owner != rank or region in done:
            continue
        done.add(region)
        data = None
        for wanted in needed:
            overlap = intersect(wanted, region)
            if overlap is None or overlap in pieces:
                continue
            if data is None:
                data = np.asarray(shard.data)
            pieces[overlap] = data[relative(overlap, region)]
    return list(pieces.items())


def _assemble_global(
    shape: tuple[int, ...], dtype: np.dtype, target: jax.sharding.Sharding, pieces: Pieces, name: str
) -> jax.Array:
    """The global array laid out as ``target`` whose local shards are cut from ``pieces``."""
    buffers = []
    devices_indices = target.addressable_devices_indices_map(shape)
    for device, index in devices_indices.items():
        assert index is not None  # each device of the sharding holds its slice
        region = normalize(index, shape)
        whole = next((data for piece_index, data in pieces if piece_index == region), None)
        if whole is not None:  # one piece is this device's slice: straight to the device, no staging copy
            buffers.append(jax.device_put(whole, device))
            continue
        local = np.empty(extent(region), dtype)
        covered = 0
        for piece_index, data in pieces:
            overlap = intersect(piece_index, region)
            if overlap is None:
                continue
            local[relative(overlap, region)] = data[relative(overlap, piece_index)]
            covered += int(np.prod(extent(overlap)))
        if covered != int(np.prod(extent(region))):
            raise RuntimeError(
                f"value {name}: received {covered} of the {int(np.prod(extent(region)))} elements "
                f"device {device} needs (a transport bug: the senders' split disagrees)"
            )
        buffers.append(jax.device_put(local, device))
    return jax.make_array_from_single_device_arrays(shape, target, buffers)
