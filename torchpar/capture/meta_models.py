"""Capturing a model built on the meta device under ``torch.autocast``.

A meta tensor carries no autocast dispatch key: ``torch.autocast("cpu", torch.float16)`` leaves a matmul of meta
tensors in float32, so a meta model captured for ``mixed_precision`` would be priced as if it trained in fp32
(twice its activation bytes). :func:`as_fake_cpu` swaps the model's parameters and buffers and the batch for
fake tensors (``FakeTensor``: shape, dtype and a device, no storage) that claim to live on the CPU, so the CPU
autocast policy applies exactly as it does to a real CPU model; ``torch.export`` runs on them in their own fake
mode. Nothing is allocated; the model gets its meta tensors back on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode


def is_without_data(tensor: torch.Tensor) -> bool:
    """A tensor with no values to read: on the meta device, or a fake tensor standing in for one."""
    return tensor.device.type == "meta" or isinstance(tensor, FakeTensor)


def on_meta_device(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters and buffers live on the meta device (a model built to be planned)."""
    tensors = [*model.parameters(), *model.buffers()]
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


@contextlib.contextmanager
def as_fake_cpu(
    model: torch.nn.Module, args: tuple[object, ...], kwargs: dict[str, object]
) -> Iterator[tuple[tuple[object, ...], dict[str, object]]]:
    """Inside: ``model``'s meta parameters and buffers are fake CPU tensors (same shapes, dtypes and
    ``requires_grad``; tied parameters stay one object), and the call arguments yielded are the batch's tensors
    as fake CPU tensors. On exit every module holds its original meta tensors again."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    swapped: dict[int, torch.Tensor] = {}  # id(meta tensor) -> its fake stand-in (tied weights share one)

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in swapped:
            meta = tensor if tensor.device.type == "meta" else tensor.to("meta")
            stand_in: torch.Tensor = FakeTensor(mode, meta.detach(), torch.device("cpu"))
            if isinstance(tensor, torch.nn.Parameter):
                stand_in = torch.nn.Parameter(stand_in, requires_grad=tensor.requires_grad)
            swapped[id(tensor)] = stand_in
        return swapped[id(tensor)]

    originals: list[tuple[dict[str, Any], str, torch.Tensor]] = []
    for module in model.modules():
        tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
        for table in tables:
            for name, tensor in list(table.items()):
                if tensor is not None:
                    originals.append((table, name, tensor))
                    table[name] = fake(tensor)
    try:
        yield pytree.tree_map(lambda leaf: fake(leaf) if isinstance(leaf, torch.Tensor) else leaf, (args, kwargs))
    finally:
        for table, name, tensor in originals:
            table[name] = tensor
