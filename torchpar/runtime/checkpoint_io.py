"""Sharded checkpoint files: what each worker process writes, and how it reads back only the slices it needs.

A checkpoint is a directory (:mod:`torchpar.checkpoint` makes it atomic and writes its index). Inside, every
process that holds a piece of the training state writes the pieces it holds, one safetensors file per device::

    rank0-dev0.safetensors   rank0-dev1.safetensors   rank1-dev2.safetensors ...   index.json (written last)

- **Deduplicated.** Of the copies of one slice (a replicated parameter lives on every device of the mesh), only
  replica 0 is written (JAX numbers replicas globally, so exactly one process writes each distinct slice); a
  tied parameter held by several pipeline stages is written by its first stage only.
- **Addressed by global slices.** A piece is stored under the key ``"{tensor}@{offsets}"`` and described in
  the manifest by its file, its global ``offsets`` (start per dim) and its ``shape``. A tensor's pieces tile it
  exactly once.
- **Read lazily.** :class:`ShardReader` builds a device's shard from the pieces overlapping it, reading each
  overlap with safetensors' ``safe_open(...).get_slice`` (an mmap'd read of those bytes only), so a process
  reads what its devices hold under the *loading* plan, whatever plan wrote the checkpoint (resharding).

Tensor keys: ``param/<name>``, ``buffer/<name>``, ``state/<parameter>/<state key>`` (names as in
``model.named_parameters()``; torch optimizer state keys). Arrays are stored in the dtype JAX holds them in
(``bfloat16`` through ``ml_dtypes``, safetensors' ``BF16``; an ``int64`` buffer as ``int32`` with x64 off) and their
exact shapes (a 0-d tensor such as BatchNorm's ``num_batches_tracked`` as shape ``[]``).

Why safetensors: a maintained format (HuggingFace's, a Rust core with Python bindings, the file format of the Hub's
models) that is a JSON header plus raw little-endian bytes, so a slice of a tensor is read without reading the
rest (``get_slice`` on an mmap) and nothing is unpickled (no code runs on load, unlike ``torch.save``); it stores
``bfloat16``; and it needs neither torch nor JAX (``safetensors.numpy``), so host actors write it without
importing torch. What it lacks — a tensor split across files, global offsets, atomic commits — is the small JSON
index :mod:`torchpar.checkpoint` writes beside the files. (Orbax/TensorStore's zarr would also give sharded,
sliced reads, but pulls in a larger dependency and a directory per array.)

Memory: a process copies one device's pieces to the host at a time (just before writing that device's file), so
writing needs the largest per-device share of the state in host memory, never the whole model. Files are written
one after another within a process (each process of the Ray runtime writes at the same time as the others).
"""

from __future__ import annotations

import math
import os
import socket
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

from torchpar.runtime.arrays import Index, intersect, relative
from torchpar.runtime.state import EntryName

if TYPE_CHECKING:
    import jax
    from safetensors import safe_open

KINDS = ("param", "buffer", "state")

StateArray: TypeAlias = "jax.Array | np.ndarray"
"""A state array a process writes: on its devices, or a host array (the driver's)."""


class FileEntry(TypedDict):
    """One shard file in the manifest: who wrote it (writer, process id, host), for which device, its size."""

    writer: str
    pid: int
    host: str
    device: str
    bytes: int


class PieceEntry(TypedDict):
    """One stored piece of a tensor in the manifest: its file, key in it, global offsets and shape."""

    file: str
    key: str
    offsets: list[int]
    shape: list[int]


class TensorEntry(TypedDict):
    """One tensor in the manifest (and the checkpoint's index): its global shape, dtype and stored pieces."""

    shape: list[int]
    dtype: str
    pieces: list[PieceEntry]


def tensor_key(kind: str, name: EntryName) -> str:
    """The checkpoint's name of one state array (see the module docstring)."""
    if kind == "state":
        return f"state/{name[0]}/{name[1]}"
    return f"{kind}/{name}"


def _piece_key(key: str, offsets: tuple[int, ...]) -> str:
    return f"{key}@{','.join(map(str, offsets))}"


def _write_file(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str]) -> None:
    """One safetensors file, flushed to disk (``fsync``) before returning, readable as any file this process
    creates (``0666`` less the umask: safetensors itself writes ``0600``, which other users of a shared file system
    could not read)."""
    from safetensors.numpy import save_file

    save_file(tensors, path, metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    """This process's file-creation mask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_shards(directory: str, arrays: Iterable[tuple[str, StateArray]], *, writer: str) -> dict[str, Any]:
    """Write this process's pieces of ``arrays`` (``(tensor key, jax.Array or host array)``) into ``directory``,
    one file per device (host arrays: one file ``{writer}-host``), and return the manifest the index is built from:
    ``{"files": {file: {writer, pid, host, device, bytes}}, "tensors": {key: {shape, dtype, pieces: [...]}}}``.
    Files are written one after another, each device's pieces copied to the host just before its file is written."""
    by_file: dict[str, list[tuple[str, StateArray]]] = {}
    devices: dict[str, str] = {}
    tensors: dict[str, TensorEntry] = {}
    for key, array in arrays:
        entry = tensors.setdefault(key, {"shape": list(array.shape), "dtype": np.dtype(array.dtype).name, "pieces": []})
        for file, device, offsets, data in _pieces(array, writer):
            devices[file] = device
            by_file.setdefault(file, []).append((_piece_key(key, offsets), data))
            entry["pieces"].append(
                {"file": file, "key": _piece_key(key, offsets), "offsets": list(offsets), "shape": list(data.shape)}
            )
    files: dict[str, FileEntry] = {}
    host, pid = socket.gethostname(), os.getpid()
    for file, pieces in sorted(by_file.items()):
        path = os.path.join(directory, file)
        content = {piece_key: _host_piece(data) for piece_key, data in pieces}
        _write_file(path, content, {"format": "torchpar-shard", "writer": writer, "device": devices[file]})
        del content
        files[file] = {
            "writer": writer,
            "pid": pid,
            "host": host,
            "device": devices[file],
            "bytes": os.path.getsize(path),
        }
    return {"files": files, "tensors": {k: v for k, v in tensors.items() if v["pieces"]}}


def _host_piece(data: StateArray) -> np.ndarray:
    """A piece as the C-contiguous host array safetensors writes, of exactly its shape and dtype.

    Not ``np.ascontiguousarray``: it returns at least one dimension, so a 0-d tensor (BatchNorm's
    ``num_batches_tracked``) would be stored as shape ``[1]`` while the index says ``[]``."""
    host = np.asarray(data, order="C")
    assert host.shape == tuple(data.shape) and host.flags.c_contiguous, (host.shape, data.shape)
    return host


def _pieces(array: StateArray, writer: str) -> Iterable[tuple[str, str, tuple[int, ...], StateArray]]:
    """``(file, device, offsets, data)`` of each piece of ``array`` this process writes: replica 0 of each shard
    on its devices, its data still on the device (host arrays: the whole array)."""
    if isinstance(array, np.ndarray):
        yield f"{writer}-host.safetensors", "host", (0,) * array.ndim, array
        return
    for shard in array.addressable_shards:
        if shard.replica_id != 0:
            continue
        offsets = tuple(s.start or 0 for s in shard.index)
        yield f"{writer}-dev{shard.device.id}.safetensors", str(shard.device), offsets, shard.data


def merge_manifests(manifests: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The manifests of every writer as one: each tensor's pieces from all processes (they must tile it exactly:
    an invariant of replica-0 deduplication)."""
    files: dict[str, FileEntry] = {}
    tensors: dict[str, TensorEntry] = {}
    for manifest in manifests:
        files.update(manifest["files"])
        entries: dict[str, TensorEntry] = manifest["tensors"]
        for key, entry in entries.items():
            merged = tensors.setdefault(key, {**entry, "pieces": []})
            assert merged["shape"] == entry["shape"] and merged["dtype"] == entry["dtype"], (key, merged, entry)
            merged["pieces"].extend(entry["pieces"])
    for key, entry in tensors.items():
        covered = sum(math.prod(p["shape"]) for p in entry["pieces"])
        assert covered == math.prod(entry["shape"]), f"{key}: pieces cover {covered} of {entry['shape']}"
    return {"files": files, "tensors": tensors}


class ShardReader:
    """Reads slices of a checkpoint's tensors from its shard files (``tensors``: the index's entries).

    A worker builds its arrays with :meth:`place` (each device's shard from the pieces overlapping it), the
    driver whole tensors with :meth:`read`. Files are opened (mmap'd) on first use and closed by :meth:`close`."""

    def __init__(self, directory: str, tensors: Mapping[str, TensorEntry]):
        self.directory = directory
        self.tensors = tensors
        self._open: dict[str, safe_open] = {}
        self.bytes_read = 0

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._open.clear()

    def _file(self, name: str) -> safe_open:
        if name not in self._open:
            from safetensors import safe_open

            path = os.path.join(self.directory, name)
            try:
                self._open[name] = safe_open(path, framework="np")
            except Exception as error:  # safetensors raises its own SafetensorError (or OSError) naming no file
                raise ValueError(
                    f"checkpoint shard file {path} cannot be read ({type(error).__name__}: {error}): it is "
                    "damaged or truncated; restore it from a copy or load an earlier checkpoint"
                ) from error
        return self._open[name]

    def read(self, key: str, index: Index | None = None) -> np.ndarray:
        """The slice ``index`` (``(start, stop)`` per dim; ``None``: all) of tensor ``key``, read from the pieces
        overlapping it only."""
        entry = self.tensors[key]
        shape = tuple(entry["shape"])
        index = tuple((0, n) for n in shape) if index is None else index
        out = np.empty(tuple(hi - lo for lo, hi in index), np.dtype(_numpy_dtype(entry["dtype"])))
        covered = 0
        for piece in entry["pieces"]:
            stored = tuple((o, o + n) for o, n in zip(piece["offsets"], piece["shape"]))
            overlap = intersect(stored, index) if shape else ()
            if overlap is None:
                continue
            data = self._read_piece(key, piece, relative(overlap, stored))
            out[relative(overlap, index)] = data
            covered += math.prod(hi - lo for lo, hi in overlap)
            self.bytes_read += data.nbytes
        if covered != out.size:
            raise ValueError(
                f"the checkpoint's pieces of {key} cover {covered} of the {out.size} elements of slice "
                f"{list(index)}: its files are damaged or the index does not match them"
            )
        return out

    def _read_piece(self, key: str, piece: PieceEntry, where: tuple[slice, ...]) -> np.ndarray:
        """The part ``where`` of one stored piece (``where`` is ``()`` for a 0-d tensor). The file's shape of the
        piece must be the index's; the one exception read as it was meant: a 0-d tensor that an earlier torchpar
        stored as shape ``[1]``."""
        stored = self._file(piece["file"]).get_slice(piece["key"])
        shape = tuple(stored.get_shape())
        expected = tuple(piece["shape"])
        if shape == expected:
            return stored[where] if where else self._file(piece["file"]).get_tensor(piece["key"])
        if expected == () and shape == (1,):
            return self._file(piece["file"]).get_tensor(piece["key"]).reshape(())
        raise ValueError(
            f"piece {piece['key']!r} of {key} in {piece['file']} has shape {list(shape)}, the "
            f"checkpoint's index says {list(expected)}: its files are damaged or the index does not "
            "match them"
        )

    def place(self, key: str, sharding: jax.sharding.Sharding) -> jax.Array:
        """Tensor ``key`` laid out as ``sharding``: each of this process's devices gets its shard, read from the
        files (a shard that several local devices hold is read once)."""
        import jax

        from jaxbackend.lower import to_numpy_input
        from torchpar.runtime.arrays import normalize

        shape = tuple(self.tensors[key]["shape"])
        cache: dict[Index, np.ndarray] = {}

        def shard(index: tuple[slice, ...] | None) -> np.ndarray:
            assert index is not None  # JAX gives every device of a sharding its index
            normalized = normalize(index, shape)
            if normalized not in cache:
                cache[normalized] = to_numpy_input(self.read(key, normalized))
            return cache[normalized]

        return jax.make_array_from_callback(shape, sharding, shard)


class CheckpointSource:
    """A checkpoint as the state a worker loads (the interface of :class:`~.state.HostState` that
    ``Worker.load`` reads): the names it holds and :meth:`place`, which builds each array from the files."""

    def __init__(self, reader: ShardReader):
        self.reader = reader
        self.params: dict[str, None] = {}
        self.buffers: dict[str, None] = {}
        self.opt_state: dict[str, dict[str, None]] = {}
        for key in reader.tensors:
            kind, _, rest = key.partition("/")
            if kind == "param":
                self.params[rest] = None
            elif kind == "buffer":
                self.buffers[rest] = None
            elif kind == "state":
                name, _, state_key = rest.rpartition("/")
                self.opt_state.setdefault(name, {})[state_key] = None

    def place(self, kind: str, name: EntryName, sharding: jax.sharding.Sharding) -> jax.Array:
        return self.reader.place(tensor_key(kind, name), sharding)


def _numpy_dtype(name: str) -> npt.DTypeLike:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)
