"""Batches as the engine sees them: a batch's *signature* (its structure, every leaf's shape and dtype: one
compiled step per signature), the check that a batch fits the example batch's, and micro-batch slicing."""

from __future__ import annotations

import math
from typing import TypeAlias

import numpy as np
import torch
import torch.utils._pytree as pytree

from torchpar.capture.errors import describe_batch_mismatch
from torchpar.capture.export import batch_to_call_args, call_args_to_batch
from torchpar.capture.to_ir import dtype_name
from torchpar.engine.guard import leaf_names

Signature: TypeAlias = tuple[str, tuple[tuple[tuple[int, ...], str], ...]]
"""A batch's signature (:func:`signature`): its structure, then every leaf's ``(shape, dtype name)``."""


def signature(batch: object) -> Signature:
    """``(structure, ((shape, dtype), ...))`` of ``batch``'s leaves; a ``TypeError`` naming a leaf that is not a
    tensor."""
    leaves, spec = pytree.tree_flatten(batch_to_call_args(batch))
    if not all(isinstance(leaf, torch.Tensor) for leaf in leaves):
        paths, _ = pytree.tree_flatten_with_path(batch)
        path, leaf = next((p, v) for p, v in paths if not isinstance(v, torch.Tensor))
        raise TypeError(
            f"batch{pytree.keystr(path)} is a {type(leaf).__name__}; every batch leaf must be a "
            "torch.Tensor (make lists and numbers tensors with torch.tensor(...))"
        )
    return str(spec), tuple((tuple(leaf.shape), dtype_name(leaf.dtype)) for leaf in leaves)


def describe(signature: Signature) -> str:
    """A signature's leaves as ``float32[8, 16], int64[8]``."""
    return ", ".join(f"{dtype}{list(shape)}" for shape, dtype in signature[1])


def skeleton(batch: object) -> object:
    """``batch``'s structure, shapes and dtypes, without its data (tensors on the meta device)."""
    return pytree.tree_map(lambda leaf: leaf.to("meta") if isinstance(leaf, torch.Tensor) else leaf, batch)


def check_compatible(
    signature: Signature, batch: object, example_signature: Signature, example_skeleton: object
) -> None:
    """A ``ValueError`` unless ``batch`` has the example batch's structure and each leaf its dtype and rank (sizes
    may change)."""
    spec, leaves = signature
    example_spec, example_leaves = example_signature
    if spec != example_spec:
        raise ValueError(
            f"the batch's structure differs from the example batch's: "
            f"{describe_batch_mismatch(example_skeleton, batch)}"
        )
    for index, ((shape, dtype), (example_shape, example_dtype)) in enumerate(zip(leaves, example_leaves)):
        if dtype != example_dtype or len(shape) != len(example_shape):
            raise ValueError(
                f"{leaf_names(batch)[index]} is {dtype}{list(shape)} but the example batch has "
                f"{example_dtype}{list(example_shape)}: dtype and rank must match the example "
                "(sizes may change; each new shape compiles once)"
            )
        if shape and shape[0] == 0:
            raise ValueError(
                f"{leaf_names(batch)[index]} has no rows (shape {list(shape)}): an empty batch has "
                "nothing to train on; skip it (an empty shard of a dataset, a filter that kept nothing?)"
            )


def call_leaves(batch: object) -> list[torch.Tensor]:
    """The batch's leaves in the order the step takes them (its call arguments, flattened)."""
    return pytree.tree_leaves(batch_to_call_args(batch))


def first_micro_batch(batch: object, num_micro_batches: int, data_replicas: int = 1) -> object:
    """The first of ``num_micro_batches · data_replicas`` equal slices of every batch leaf along dim 0 (for capture:
    one micro-batch of one data replica): a ``ValueError`` naming the leaf if one does not split; ``batch`` itself
    for one part."""
    parts = num_micro_batches * data_replicas
    if parts == 1:
        return batch
    if data_replicas == 1:
        what, count, fix = (
            f"{parts} equal micro-batches",
            f"num_micro_batches={parts}",
            "a num_micro_batches that divides every batch size",
        )
    else:
        what, count, fix = (
            f"{data_replicas} data replicas × {num_micro_batches} micro-batch(es)",
            str(parts),
            "fewer data replicas (mesh_shape) or micro-batches",
        )
    args, kwargs = batch_to_call_args(batch)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    for index, leaf in enumerate(leaves):
        if leaf.dim() == 0:
            raise ValueError(
                f"batch leaf {index} is a scalar: it cannot be split into {what} along dim 0 "
                "(num_micro_batches > 1 needs a batch dim on every leaf)"
            )
        if leaf.shape[0] % parts:
            raise ValueError(
                f"batch leaf {index} of shape {list(leaf.shape)} cannot be split into {what} along dim 0: its batch "
                f"size {leaf.shape[0]} is not a multiple of {count}. Pass batches whose size divides by {parts} "
                f"(drop an epoch's smaller last batch with DataLoader(..., drop_last=True)), or compile with {fix}"
            )
    sliced = [leaf[: leaf.shape[0] // parts] for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(sliced, spec)
    return call_args_to_batch(type(batch), args, kwargs)


def splittable_rows(batch: object) -> int:
    """The greatest number of equal parts every leaf of ``batch`` splits into along dim 0 (the gcd of their batch
    sizes): what a searched micro-batch count must divide. A ``ValueError`` naming a leaf with no batch dim."""
    leaves = call_leaves(batch)
    for index, leaf in enumerate(leaves):
        if leaf.dim() == 0:
            raise ValueError(
                f"batch leaf {index} is a scalar: num_micro_batches='auto' cuts every leaf into "
                "micro-batches along dim 0, so each needs a batch dim"
            )
    return math.gcd(*(int(leaf.shape[0]) for leaf in leaves)) if leaves else 1


def split_leaves(leaves: list[np.ndarray], parts: int) -> list[list[np.ndarray]]:
    """Each of ``parts`` equal micro-batches of ``leaves`` (split along dim 0)."""
    return [
        [leaf[m * (leaf.shape[0] // parts) : (m + 1) * (leaf.shape[0] // parts)] for leaf in leaves]
        for m in range(parts)
    ]


def take_rows(batch: object, rows: int) -> object:
    """``batch`` with every tensor leaf cut to its first ``rows`` rows (dim 0)."""
    return pytree.tree_map(lambda leaf: leaf[:rows] if isinstance(leaf, torch.Tensor) and leaf.dim() else leaf, batch)
