"""Sharded checkpoints on disk: ``engine.save(path)``, ``engine.load(path)``, ``torchpar.load_checkpoint(path)``,
and model exports for PyTorch (``engine.export_torch_state_dict()``) and HuggingFace (``engine.save_pretrained``);
also the in-memory ``engine.state_dict()`` / ``load_state_dict`` and the copies between the torch objects and the
executor (the initial state, ``engine.sync_to_torch()``). Each function takes a :class:`TrainingState`, what the
engine holds that a checkpoint reads or restores, rather than the engine.

**What a checkpoint holds.** Parameters, buffers and every optimizer state tensor (as shards, see below); in the
index: the optimizer's step counters and ``param_groups`` hyper-parameters (``lr``, ``betas``, ``initial_lr``, …),
the engine's step count and PRNG key (dropout continues where it stopped), the fp16 loss scale, and the state of
an LR scheduler passed as ``scheduler=``. A resumed run trains exactly as the uninterrupted one would: bit for bit
under the same plan (dropout included), to float rounding under another (whose dropout masks, drawn per device from
the same PRNG position, differ).

**Layout** (a directory)::

    path/
      rank0-dev0.safetensors  rank0-dev1.safetensors  rank1-dev2.safetensors  …   the shards
      index.json                                                                  written last

Every process holding state writes its own shards in parallel — on the Ray runtime each host actor writes the
files of its devices, the driver none — each distinct slice once (replica 0 only; :mod:`torchpar.runtime.
checkpoint_io` has the file format and why it is safetensors). ``index.json`` maps each tensor (``param/<name>``,
``buffer/<name>``, ``state/<param>/<key>``) to its global shape, dtype and pieces (file, safetensors key, global
offsets, shard shape), records which process wrote each file (rank, pid, host, device, bytes), and carries the
host-side state above. On the Ray runtime ``path`` must be on a file system every host sees (NFS, Lustre, a
mounted bucket): actors write there directly.

**Atomic.** The shards and the index go into a hidden directory beside the target (``.name.tmp-…``); files are
fsync'd, the index is written last (through a temporary file renamed into place) with ``"complete": true``, and
only then does the directory take the target's name: a new path by ``rename``, an existing checkpoint by
exchanging the two directories atomically (Linux ``renameat2(RENAME_EXCHANGE)``; elsewhere two renames, the old
checkpoint kept as ``.name.old-…`` until the new one is in place). A save killed at any point leaves the previous
checkpoint at ``path`` as it was; the half-written directory is never at ``path``, has no index and is refused
by :func:`read_index` (the next save of the same path removes it once its writer is dead).

**Resharding on load.** ``engine.load`` reads the index, checks it against the model and optimizer, and each
worker builds every array it holds under *its* plan with ``jax.make_array_from_callback``: the callback of a
device reads the pieces overlapping that device's slice (``safe_open(...).get_slice``). A ZeRO-3 checkpoint loads
into one device, a 2-stage pipeline, another mesh or the Ray runtime, and no process reads more than its own
devices hold (except replicated arrays, which every holder reads whole).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import shutil
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from torchpar.engine.host_arrays import host_array, host_copy, host_tensor, to_torch

if TYPE_CHECKING:
    import jax

    from torchpar.capture.optimizer import TorchOptimizerBridge
    from torchpar.planner.plan import Plan
    from torchpar.runtime.executor import Executor
    from torchpar.runtime.loss_scale import LossScaler
    from torchpar.runtime.state import HostState

log = logging.getLogger(__name__)

FORMAT = "torchpar-sharded-checkpoint"
VERSION = 1
INDEX = "index.json"


class CheckpointError(ValueError):
    """A path that is not a complete torchpar checkpoint, or one that does not fit the engine loading it."""


# --- what is saved -------------------------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class TrainingState:
    """What a checkpoint writes and restores, by reference: the executor holding the arrays, the torch model and
    optimizer they belong to, and the run's position. The engine builds one per call; restoring replaces
    ``steps_taken`` and ``base_key`` here, and the engine takes them back."""

    executor: Executor
    """The :class:`~torchpar.runtime.executor.Executor` holding parameters, buffers and optimizer state."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: Mapping[str, torch.Tensor]
    """The model's parameters by name (a tied tensor under its first name)."""
    buffers: Mapping[str, torch.Tensor]
    bridge: TorchOptimizerBridge
    """The :class:`~torchpar.capture.optimizer.TorchOptimizerBridge`: the optimizer's spec and step counters."""
    plan: Plan
    seed: int
    """``compile(seed=...)``."""
    loss_scaler: LossScaler | None
    """The fp16 :class:`~torchpar.runtime.loss_scale.LossScaler`, else ``None``."""
    steps_taken: int
    base_key: jax.Array
    """The PRNG key each step's key is folded from."""
    translating_failures: Callable[[str], contextlib.AbstractContextManager[None]]
    """Turns a worker's failure while doing ``what`` into the engine's error."""
    data_cursor: dict[str, Any] | None = None
    """Host-loaded data's position (:meth:`torchpar.engine.feeding.HostFeed.cursor`), else ``None``; restoring replaces
    it with the checkpoint's."""
    check_data_cursor: Callable[[dict[str, Any] | None], None] | None = None
    """Raises when a checkpoint's data cursor cannot continue this engine's data; called before anything loads."""


# --- between the torch objects and the executor --------------------------------------------------------------


def torch_state(
    params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], bridge: TorchOptimizerBridge
) -> HostState:
    """The torch model's parameters and buffers and the optimizer's state (``bridge``: its
    :class:`~torchpar.capture.optimizer.TorchOptimizerBridge`) as a :class:`~torchpar.runtime.state.HostState`, for the
    executor to start from."""
    from torchpar.runtime.state import HostState

    return HostState(
        params={n: host_copy(p) for n, p in params.items()},
        buffers={n: host_copy(b) for n, b in buffers.items()},
        opt_state={n: {k: host_array(v) for k, v in e.items()} for n, e in bridge.initial_state().items()},
    )


def sync_to_torch(training: TrainingState, trained: Callable[[], set[str]]) -> None:
    """``engine.sync_to_torch()``: copy the executor's parameters, buffers and optimizer state into the torch model
    and optimizer (the state of the parameters ``trained()`` names)."""
    state = training.executor.export_state()
    with torch.no_grad():
        for name, param in training.params.items():
            param.copy_(to_torch(state.params[name]).to(param.dtype))
        for name, buffer in training.buffers.items():
            buffer.copy_(to_torch(state.buffers[name]).to(buffer.dtype))
    training.bridge.write_back(state.opt_state, trained=trained())


# --- in memory (engine.state_dict / engine.load_state_dict) ----------------------------------------------------


def state_dict(training: TrainingState) -> dict[str, object]:
    """``engine.state_dict()``: the executor's state gathered to this process as CPU torch tensors (parameters and
    buffers in the model's dtypes), the optimizer's counters, the step count, the seed and the fp16 loss scaler's
    state (when there is one)."""
    state = training.executor.export_state()
    return {
        "params": {n: to_torch(v).to(training.params[n].dtype) for n, v in state.params.items()},
        "buffers": {n: to_torch(v).to(training.buffers[n].dtype) for n, v in state.buffers.items()},
        "optimizer": {n: {k: to_torch(v) for k, v in e.items()} for n, e in state.opt_state.items()},
        "optimizer_counters": training.bridge.state_dict(),
        "steps_taken": training.steps_taken,
        "seed": training.seed,
        **({"loss_scaler": training.loss_scaler.state_dict()} if training.loss_scaler is not None else {}),
    }


def load_state_dict(training: TrainingState, state: Mapping[str, Any]) -> None:
    """``engine.load_state_dict(state)``: check ``state`` against the model and optimizer, load its arrays into the
    executor, its counters into the optimizer bridge and the loss scaler, and its step count and seed (a PRNG key
    made from it, if it differs from this engine's) into ``training``."""
    import jax

    from torchpar.engine.guard import validate_checkpoint
    from torchpar.ir.optimizer import state_keys
    from torchpar.runtime.state import HostState

    spec = training.bridge.spec
    keys = {
        n: list(state_keys(spec, g, training.params[n].ndim)) for n, g in zip(spec.param_names, spec.group_of_param)
    }
    validate_checkpoint(state, training.params, training.buffers, keys)
    training.executor.load_state(
        HostState(
            params={n: host_tensor(v) for n, v in state["params"].items()},
            buffers={n: host_tensor(v) for n, v in state["buffers"].items()},
            opt_state={n: {k: host_tensor(v) for k, v in e.items()} for n, e in state["optimizer"].items()},
        )
    )
    training.bridge.load_state_dict(state["optimizer_counters"])
    training.steps_taken = int(state["steps_taken"])
    if training.loss_scaler is not None and "loss_scaler" in state:
        training.loss_scaler.load_state_dict(state["loss_scaler"])
    if int(state["seed"]) != training.seed:
        log.warning(
            "checkpoint seed %s differs from this engine's seed %s; using the checkpoint's",
            state["seed"],
            training.seed,
        )
        training.base_key = jax.random.key(int(state["seed"]))


# --- save -------------------------------------------------------------------------------------------------------


def save(
    training: TrainingState, path: str | os.PathLike, *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
) -> Path:
    """Write the engine's training state as a sharded checkpoint at ``path`` (see the module docstring); returns the
    path. ``scheduler``: a torch LR scheduler whose state is saved too."""
    target = Path(path).absolute()
    _check_replaceable(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    temporary = target.parent / f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    temporary.mkdir()
    start = time.perf_counter()
    try:
        with training.translating_failures("saving a checkpoint"):
            manifest = training.executor.save_shards(str(temporary))
        index = {
            "format": FORMAT,
            "version": VERSION,
            **_host_state(training, scheduler),
            **manifest,
            "write_s": time.perf_counter() - start,
            "complete": True,
        }
        _check_files(temporary, index["files"])
        _write_json_durably(temporary / INDEX, index)
        _fsync(temporary)
        _commit(temporary, target)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    log.info(
        "torchpar: saved checkpoint %s (%d files, %.1f MiB) in %.2fs",
        target,
        len(index["files"]),
        sum(f["bytes"] for f in index["files"].values()) / 2**20,
        time.perf_counter() - start,
    )
    return target


def _host_state(training: TrainingState, scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> dict[str, Any]:
    """What the index holds beside the shards: counters, hyper-parameters, PRNG, loss scale, scheduler, and the
    model's names and torch dtypes (for loading into torch without an engine)."""
    import jax

    model, plan = training.model, training.plan
    by_id = {id(t): ("param", n) for n, t in training.params.items()}
    by_id.update({id(t): ("buffer", n) for n, t in training.buffers.items()})
    return {
        "steps_taken": training.steps_taken,
        "prng": {
            "seed": training.seed,
            "impl": str(jax.random.key_impl(training.base_key)),
            "base_key_data": [int(x) for x in jax.random.key_data(training.base_key)],
        },
        "optimizer": {
            "counters": training.bridge.state_dict(),
            "param_groups": [
                {k: _plain(v) for k, v in group.items() if k != "params"} for group in training.optimizer.param_groups
            ],
        },
        "loss_scaler": training.loss_scaler.state_dict() if training.loss_scaler is not None else None,
        "scheduler": _plain(scheduler.state_dict()) if scheduler is not None else None,
        "data": training.data_cursor,
        "model": {
            "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "torch_dtypes": {
                **{f"param/{n}": str(p.dtype) for n, p in training.params.items()},
                **{f"buffer/{n}": str(b.dtype) for n, b in training.buffers.items()},
            },
            "state_dict_keys": {
                key: "/".join(by_id[id(t)]) for key, t in model.state_dict(keep_vars=True).items() if id(t) in by_id
            },
        },
        "plan": {
            "method": plan.method,
            "stages": len(plan.stages),
            "devices": sorted({d for s in plan.stages for d in s.devices()}),
        },
    }


def _plain(value: object) -> object:
    """``value`` as JSON data (tensors as numbers or lists, tuples as lists)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(
        f"cannot save {type(value).__name__} {value!r} in a checkpoint's index (JSON): the scheduler's "
        "or optimizer's state must be numbers, strings, lists and dicts"
    )


def _check_replaceable(target: Path) -> None:
    """Refuse to replace anything but a torchpar checkpoint (or an empty directory) at ``target``."""
    if not target.exists():
        return
    if target.is_dir() and (not any(target.iterdir()) or _is_checkpoint(target)):
        return
    raise CheckpointError(
        f"{target} exists and is not a torchpar checkpoint: refusing to replace it (save to a new "
        "path, or remove it first)"
    )


def _is_checkpoint(path: Path) -> bool:
    try:
        return json.loads((path / INDEX).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _remove_stale_temporaries(target: Path) -> None:
    """Remove half-written directories of earlier saves of ``target`` whose process (on this host) is gone."""
    prefix = f".{target.name}.tmp-{socket.gethostname()}-"
    for candidate in target.parent.glob(f"{prefix}*"):
        pid = candidate.name[len(prefix) :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(candidate, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _check_files(directory: Path, files: Mapping[str, Mapping[str, object]]) -> None:
    """Every shard file the writers reported is there with its size (on a shared file system: visible here)."""
    for name, info in files.items():
        path = directory / name
        size = path.stat().st_size if path.exists() else None
        if size != info["bytes"]:
            raise CheckpointError(
                f"shard file {path} written by {info['writer']} (pid {info['pid']} on "
                f"{info['host']}) is {'missing' if size is None else f'{size} bytes'} here, "
                f"{info['bytes']} bytes where it was written: is {directory.parent} on a file "
                "system every host shares?"
            )


def _write_json_durably(path: Path, data: Mapping[str, object]) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.rename(partial, path)


def _fsync(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(temporary: Path, target: Path) -> None:
    """Put the finished directory at ``target``; an existing checkpoint there stays valid until this is done."""
    if not target.exists():
        os.rename(temporary, target)
    elif _exchange(temporary, target):
        shutil.rmtree(temporary)  # now the previous checkpoint
    else:
        previous = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(target, previous)
        os.rename(temporary, target)
        shutil.rmtree(previous)
    _fsync(target.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically (Linux ``renameat2`` with ``RENAME_EXCHANGE``); ``False`` where the system
    or file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


# --- load -------------------------------------------------------------------------------------------------------


def read_index(path: str | os.PathLike) -> dict[str, Any]:
    """The index of the complete checkpoint at ``path``; :class:`CheckpointError` if it is missing, unfinished (a save
    interrupted before its index was written) or damaged (a shard file missing or of another size)."""
    path = Path(path)
    if not path.is_dir():
        previous = sorted(path.parent.glob(f".{path.name}.old-*"))
        hint = (
            (
                f"; {previous[-1]} holds the checkpoint a save was replacing when it was interrupted: rename it to "
                f"{path.name}"
            )
            if previous
            else ""
        )
        raise CheckpointError(f"no checkpoint at {path}{hint}")
    if not (path / INDEX).exists():
        raise CheckpointError(
            f"{path} is not a complete torchpar checkpoint: it has no {INDEX} (the index is written "
            "last, so the save that wrote this directory was interrupted, or it is not a "
            "checkpoint); load an earlier checkpoint"
        )
    try:
        index = json.loads((path / INDEX).read_text())
    except ValueError as error:
        raise CheckpointError(f"{path / INDEX} is not valid JSON ({error}): the checkpoint is damaged") from None
    if index.get("format") != FORMAT or index.get("complete") is not True:
        raise CheckpointError(
            f"{path / INDEX} is not the index of a complete torchpar checkpoint "
            f"(format {index.get('format')!r}, complete={index.get('complete')!r})"
        )
    if index.get("version") != VERSION:
        raise CheckpointError(
            f"{path} is a version {index.get('version')} checkpoint; this torchpar reads version {VERSION}"
        )
    for name, info in index["files"].items():
        size = (path / name).stat().st_size if (path / name).exists() else None
        if size != info["bytes"]:
            raise CheckpointError(
                f"{path} is damaged: shard file {name} is "
                f"{'missing' if size is None else f'{size} bytes'}, the index says {info['bytes']}"
            )
    return index


def load(
    training: TrainingState, path: str | os.PathLike, *, scheduler: torch.optim.lr_scheduler.LRScheduler | None = None
) -> dict[str, Any]:
    """Restore the engine's training state from the checkpoint at ``path``, resharded to the engine's plan (see the
    module docstring); ``scheduler``: a torch LR scheduler to restore too. The step count and PRNG key go into
    ``training``. Returns the checkpoint's index, with ``"bytes_read"``: the shard bytes each worker read, in rank
    order (each its own devices' slices)."""
    import jax

    index = read_index(path)
    _check_fits(training, index)
    if training.check_data_cursor is not None:
        training.check_data_cursor(index.get("data"))
    if index["scheduler"] is not None and scheduler is None:
        log.warning(
            "torchpar: the checkpoint %s holds an LR scheduler's state; pass scheduler= to engine.load to restore it",
            path,
        )
    if scheduler is not None and index["scheduler"] is None:
        raise CheckpointError(f"{path} holds no LR scheduler state (it was saved without scheduler=)")
    with training.translating_failures("loading a checkpoint"):
        reads = training.executor.load_checkpoint(str(Path(path).absolute()), index["tensors"])
    training.bridge.load_state_dict(index["optimizer"]["counters"])
    _restore_param_groups(training.optimizer, index["optimizer"]["param_groups"])
    training.steps_taken = int(index["steps_taken"])
    training.data_cursor = index.get("data")
    prng = index["prng"]
    training.base_key = jax.random.wrap_key_data(
        np.asarray(prng["base_key_data"], dtype=np.uint32),  # type: ignore[arg-type]  # jax says Array; any array works
        impl=prng["impl"],
    )
    if prng["seed"] != training.seed:
        log.info(
            "torchpar: checkpoint seed %s differs from this engine's seed %s; its PRNG stream continues",
            prng["seed"],
            training.seed,
        )
    if training.loss_scaler is not None and index["loss_scaler"] is not None:
        training.loss_scaler.load_state_dict(index["loss_scaler"])
    if scheduler is not None:
        scheduler.load_state_dict(index["scheduler"])
    return {**index, "bytes_read": [r["bytes_read"] for r in reads]}


def _check_fits(training: TrainingState, index: dict[str, Any]) -> None:
    """The checkpoint has exactly this model's parameters and buffers (shapes, torch dtypes) and the optimizer state
    this optimizer keeps; raises :class:`CheckpointError` naming the first difference."""
    from torchpar.ir.optimizer import state_keys, state_shape

    tensors, dtypes = index["tensors"], index["model"]["torch_dtypes"]
    for kind, current in (("param", training.params), ("buffer", training.buffers)):
        saved = {k.partition("/")[2] for k in tensors if k.startswith(kind + "/")}
        absent, extra = sorted(set(current) - saved), sorted(saved - set(current))
        if absent or extra:
            raise CheckpointError(
                f"the checkpoint's {kind}s differ from the model's: missing {absent[:5]}, not in the "
                f"model {extra[:5]} (a checkpoint of another model?)"
            )
        for name, tensor in current.items():
            entry = tensors[f"{kind}/{name}"]
            if tuple(entry["shape"]) != tuple(tensor.shape) or dtypes[f"{kind}/{name}"] != str(tensor.dtype):
                raise CheckpointError(
                    f"checkpoint {kind} {name} is {dtypes[f'{kind}/{name}']}{entry['shape']}, the "
                    f"model's is {tensor.dtype}{list(tensor.shape)}"
                )
    spec = training.bridge.spec
    counters = index["optimizer"]["counters"]
    if counters["kind"] != spec.kind:
        raise CheckpointError(
            f"the checkpoint was saved with a {counters['kind']!r} optimizer, this engine's is "
            f"{spec.kind!r}: build the engine with the optimizer the checkpoint was made with"
        )
    for name, group in zip(spec.param_names, spec.group_of_param):
        param = training.params[name]
        for key in state_keys(spec, group, param.ndim):
            entry = tensors.get(f"state/{name}/{key}")
            if entry is None or tuple(entry["shape"]) != state_shape(spec, key, param.shape):
                raise CheckpointError(
                    f"the checkpoint's optimizer state of {name} lacks {key!r} (saved with another "
                    "optimizer, or other param groups?)"
                )
    groups = index["optimizer"]["param_groups"]
    if len(groups) != len(training.optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(groups)} param groups, this one "
            f"{len(training.optimizer.param_groups)}"
        )


def _restore_param_groups(optimizer: torch.optim.Optimizer, saved: list[dict[str, Any]]) -> None:
    """The saved numeric hyper-parameters (``lr``, ``betas``, ``eps``, ``weight_decay``, ``initial_lr``, …) back into
    ``optimizer.param_groups``; flags (``amsgrad``, ``foreach``, …) are part of the compiled step and stay."""
    for group, values in zip(optimizer.param_groups, saved):
        for key, value in values.items():
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if isinstance(value, list) and value and all(isinstance(v, (int, float)) for v in value):
                group[key] = tuple(value)
            elif numeric and isinstance(group.get(key), torch.Tensor):
                group[key].fill_(value)
            elif numeric:
                group[key] = value


# --- reading into torch -----------------------------------------------------------------------------------------


def load_checkpoint(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model's state dict from the checkpoint at ``path`` (keys of ``model.state_dict()``, tied weights under
    each of their names, the model's dtypes), for ``model.load_state_dict``: read whole on this process, so it
    needs the model's size in host memory (the optimizer state is not read). No engine is needed."""
    from torchpar.runtime.checkpoint_io import ShardReader

    path = Path(path)
    index = read_index(path)
    dtypes = index["model"]["torch_dtypes"]
    out: dict[str, torch.Tensor] = {}
    by_key: dict[str, torch.Tensor] = {}
    with ShardReader(str(path), index["tensors"]) as reader:
        for key, tensor_name in index["model"]["state_dict_keys"].items():
            if tensor_name not in by_key:
                by_key[tensor_name] = to_torch(reader.read(tensor_name)).to(_torch_dtype(dtypes[tensor_name]))
            out[key] = by_key[tensor_name]
    return out


def _torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


def export_torch_state_dict(training: TrainingState) -> dict[str, torch.Tensor]:
    """The model's parameters and buffers as ``model.state_dict()`` keys them (tied weights under each name, one
    tensor), CPU tensors in the model's dtypes. Gathers the whole model (not the optimizer state) to this process."""
    state = training.executor.export_state(("param", "buffer"))
    values = {("param", n): v for n, v in state.params.items()}
    values.update({("buffer", n): v for n, v in state.buffers.items()})
    by_id = {id(t): ("param", n) for n, t in training.params.items()}
    by_id.update({id(t): ("buffer", n) for n, t in training.buffers.items()})
    converted: dict[tuple[str, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in training.model.state_dict(keep_vars=True).items():
        which = by_id.get(id(tensor))
        if which is None:  # not a parameter or buffer torchpar holds (e.g. extra state): as the model has it
            out[key] = tensor.detach().clone() if isinstance(tensor, torch.Tensor) else tensor
            continue
        if which not in converted:
            converted[which] = to_torch(values[which]).to(tensor.dtype)
        out[key] = converted[which]
    return out


def save_pretrained(training: TrainingState, directory: str | os.PathLike, **kwargs: object) -> None:
    """``model.save_pretrained(directory, **kwargs)`` with the engine's current weights: the parameters and buffers
    are copied into the torch model first (as :meth:`Engine.sync_to_torch` does, without the optimizer state), then
    HuggingFace writes ``config.json`` and ``model.safetensors``. The driver holds the torch model anyway; this adds
    one transient copy of the weights while they are gathered."""
    model = training.model
    save = getattr(model, "save_pretrained", None)
    if not callable(save):
        raise TypeError(
            f"{type(model).__name__} has no save_pretrained (not a HuggingFace PreTrainedModel): use "
            "engine.export_torch_state_dict() and torch.save or safetensors.torch.save_file"
        )
    state = export_torch_state_dict(training)
    with torch.no_grad():
        model.load_state_dict(state)
    save(directory, **kwargs)
