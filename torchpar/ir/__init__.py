"""The IR shared by capture, planner and lowering: see :mod:`torchpar.ir.graph`."""

from torchpar.ir.graph import DType, Graph, Input, Node, Output, Ref, TensorMeta

__all__ = ["DType", "Graph", "Input", "Node", "Output", "Ref", "TensorMeta"]
