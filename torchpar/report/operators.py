"""The report's "Operator strategies" section: what the sharding ILP chose for each anchor op of each stage.

``StagePlan.strategies`` maps an anchor op (matmul, attention, embedding, convolution, grouped matmul; IR node name) to
``"<aten target> <module path>: <strategy>"``. A strategy names which einsum label of the op is split over
which logical mesh axes, comma-separated: ``m@1`` splits label ``m`` over axis 1, ``m@0,n@1`` splits ``m`` over
axis 0 and ``n`` over axis 1, ``m@01`` splits ``m`` over both; ``replicated`` splits nothing. The labels per op
family are :data:`OP_LABELS`. The op's output layout is ``StagePlan.activations[node]``, the layout each
tensor operand must have ``StagePlan.operands[node]``.

The batch inputs a plan stores (``StagePlan.inputs``) may be replicated while the batch is split at the first
matmul or embedding: a row whose output has its leading dim split is where the batch (or batch × sequence)
is split, and the section says which op splits it first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from torchpar.ir.layout import describe
from torchpar.report.estimates import mesh_text
from torchpar.report.layout import stage_color
from torchpar.report.markup import e, ranges, spec_chips, spec_legend, swatch, table

if TYPE_CHECKING:
    from torchpar.planner.plan import Plan, StagePlan

_MATMUL = {"m": "rows (batch × sequence)", "k": "contracted dim (in features)", "n": "out features"}
_BATCHED = {"b": "batch", "m": "rows", "k": "contracted dim", "n": "columns"}
_GROUPED = {
    "experts": "experts (device i of the axis holds the i-th block of experts; tokens exchanged by all-to-all)",
    "s": "rows (tokens × top-k, sorted by expert)",
    "k": "contracted dim (expert input)",
    "n": "expert output columns",
}
OP_LABELS: dict[str, dict[str, str]] = {
    "mm": _MATMUL,
    "addmm": _MATMUL,
    "bmm": _BATCHED,
    "baddbmm": _BATCHED,
    "embedding": {
        "V": "vocabulary (table rows)",
        "D": "embedding dim",
        "a": "index dim 0 (batch)",
        "b": "index dim 1 (sequence)",
        "c": "index dim 2",
    },
    "scaled_dot_product_attention": {"b": "batch", "h": "heads", "seq": "sequence (context parallelism)"},
    "convolution": {"n": "batch", "o": "out channels", "c": "in channels (contracted)"},
    "_grouped_mm": _GROUPED,
    "transformers.grouped_mm_fallback.default": _GROUPED,
    "index": {
        "V": "table rows",
        "D": "table dim 1",
        "F": "table dim 2",
        "a": "index (output rows)",
        "rows": "rows (the table's and the output's)",
        "cols": "columns",
    },
    "index_put": {"rows": "rows (the base's, the values' and the output's)", "cols": "columns"},
}
"""What each einsum label of an anchor op's strategy stands for, by op (``aten.<op>.default``)."""
VARIANTS = {
    "ring": "keys/values passed around a ring of devices (ppermute)",
    "allgather": "keys/values all-gathered (their gradient reduce-scattered)",
    "exchange": "the index whole: only the rows another device needs move, by all-to-all",
}
"""The words of a strategy that name how its split runs: an attention's sequence meeting every key (``seq@1,ring``),
a gather's or put's rows moved by a whole index (``rows@1,exchange``)."""
OPERAND_NAMES: dict[str, tuple[str, ...]] = {
    "mm": ("input", "weight"),
    "addmm": ("bias", "input", "weight"),
    "bmm": ("a", "b"),
    "baddbmm": ("bias", "a", "b"),
    "embedding": ("table", "indices"),
    "scaled_dot_product_attention": ("q", "k", "v", "mask"),
    "convolution": ("input", "weight", "bias"),
    "_grouped_mm": ("rows", "experts' weights", "offsets"),
    "transformers.grouped_mm_fallback.default": ("rows", "experts' weights", "offsets"),
    "index": ("table", "indices"),
    "index_put": ("base", "indices", "values"),
}
_ROWS_OPEN = 40
"""Stages are shown expanded while the whole table has at most this many rows."""


def parse_strategy(label: str) -> tuple[str, str, str]:
    """``"aten.addmm.default transformer.h.0.attn.c_attn: m@1"`` → ``("addmm", "transformer.h.0.attn.c_attn",
    "m@1")``."""
    head, _, name = label.rpartition(": ")
    if not head:
        head, name = label, ""
    target, _, module = head.partition(" ")
    parts = target.split(".")
    op = parts[1] if len(parts) >= 3 and parts[0] == "aten" else target
    return op, module.strip(), name.strip()


def explain_strategy(op: str, name: str) -> str:
    """``("addmm", "m@0,n@1")`` → ``"rows (batch × sequence) over axis 0; out features over axis 1"``; a row-split
    matmul's ``k@1>m@1``: ``…; output rows reduce-scattered over axis 1 (sequence parallelism)``."""
    if not name or name == "replicated":
        return "replicated: every device computes the whole op"
    labels = OP_LABELS.get(op, {})
    name, _, scattered = name.partition(">")
    pieces = []
    for part in name.split(","):
        label, _, axes = part.partition("@")
        if not axes:
            pieces.append(VARIANTS.get(part, part))
            continue
        pieces.append(f"{labels.get(label, label)} over {_axes_text(axes)}")
    if scattered:
        pieces.append(
            f"output rows reduce-scattered over {_axes_text(scattered.partition('@')[2])} (sequence parallelism)"
        )
    return "; ".join(pieces)


def sequence_split(op: str, name: str) -> str:
    """How an op's strategy splits the sequence, in a few words ("" if it does not)."""
    if name.startswith("seq@"):
        parts = name.split(",")
        return f"context ({parts[-1]}) over {_axes_text(parts[0].partition('@')[2])}"
    if ">m@" in name:
        return f"tokens scattered over {_axes_text(name.rpartition('@')[2])}"
    return ""


def _axes_text(axes: str) -> str:
    return f"axis {axes}" if len(axes) == 1 else "axes " + " and ".join(axes)


def splits_batch(spec: Sequence[object] | None) -> bool:
    """Whether an op's output has its leading (batch) dim split."""
    return bool(spec and spec[0])


def strategies_html(plan: Plan) -> str | None:
    """One table per stage (in ``<details>``), or ``None`` when the plan records no strategies."""
    total = sum(len(getattr(s, "strategies", {}) or {}) for s in plan.stages)
    if not total:
        return None
    blocks = []
    for index, stage in enumerate(plan.stages):
        strategies = getattr(stage, "strategies", {}) or {}
        if not strategies:
            continue
        blocks.append(_stage_block(index, stage, strategies, open_=total <= _ROWS_OPEN or index == 0))
    legend = spec_legend(
        "<span><b class='chip batch' style='background:#0969da'>S1</b> leading (batch) dim split</span>"
    )
    vocabulary = (
        "<p class='sub'>A strategy names which labelled dim of the op's einsum is split over which logical "
        "mesh axis: <code>m@1</code> splits <code>m</code> over axis 1, <code>m@0,n@1</code> splits "
        "<code>m</code> over axis 0 and <code>n</code> over axis 1, <code>m@01</code> over both axes; "
        "<code>replicated</code> splits nothing. Labels: matmul <code>m</code> rows (batch × sequence), "
        "<code>k</code> contracted (its split all-reduces the output), <code>n</code> out features; "
        "attention <code>b</code> batch, <code>h</code> heads, <code>seq</code> sequence (context "
        "parallelism: <code>ring</code> or <code>allgather</code>); <code>&gt;m@1</code>: a row-split "
        "matmul's output tokens reduce-scattered (sequence parallelism); embedding <code>a</code> batch, "
        "<code>V</code> vocabulary, <code>D</code> embedding dim; convolution <code>n</code> batch, "
        "<code>o</code>/<code>c</code> out/in channels. Operands show the layout the op reads them in "
        "(– : no requirement).</p>"
    )
    return legend + vocabulary + "".join(blocks)


def _stage_block(index: int, stage: StagePlan, strategies: Mapping[str, str], *, open_: bool) -> str:
    mesh = tuple(int(d) for d in stage.logical_mesh_shape)
    activations = getattr(stage, "activations", {}) or {}
    operands = getattr(stage, "operands", {}) or {}
    groups: dict[tuple, list[tuple[str, str]]] = {}
    first_split = None
    for node, label in strategies.items():
        op, module, name = parse_strategy(str(label))
        out = activations.get(node)
        if splits_batch(out) and first_split is None:
            first_split = (node, op, module, name)
        specs = tuple(describe(spec) if spec is not None else "–" for spec in operands.get(node, []) or [])
        key = (op, _pattern(module), name, describe(out) if out is not None else "", specs)
        groups.setdefault(key, []).append((node, module))
    rows, row_attrs = [], []
    for members in groups.values():
        node = members[0][0]
        op, _, name = parse_strategy(str(strategies[node]))
        out = activations.get(node)
        batch = splits_batch(out)
        names = OPERAND_NAMES.get(op, ())
        reads = []
        for i, spec in enumerate(operands.get(node, []) or []):
            what = names[i] if i < len(names) else f"#{i}"
            reads.append(f"<span class='operand'><span class='sub'>{e(what)}</span> {spec_chips(spec)}</span>")
        modules = merge_modules([m for _, m in members])
        count = f" <span class='sub'>×{len(members)}</span>" if len(members) > 1 else ""
        explained = "" if name == "replicated" else explain_strategy(op, name)
        rows.append(
            [
                (f"<code>{e(op).replace('_', '_<wbr>')}</code>", op),
                (f"<code class='module'>{e(modules or '–')}</code>{count}", modules),
                (f"<code>{e(name or '?')}</code><div class='sub small'>{e(explained)}</div>", name),
                (e(sequence_split(op, name)) or "<span class='sub'>–</span>", sequence_split(op, name)),
                (spec_chips(out, batch_dim=True), describe(out) if out is not None else ""),
                ("".join(reads) or "<span class='sub'>–</span>", None),
            ]
        )
        row_attrs.append((" class='batchsplit'" if batch else "") + f" data-node='{e(node)}' data-ops='{len(members)}'")
    table_html = table(
        ["op", "module", "strategy", "sequence", "output", "operands"],
        rows,
        css="strategies",
        row_attrs=row_attrs,
        scroll=len(rows) > 30,
    )
    summary = (
        f"{swatch(stage_color(index))}stage {index} · logical mesh {e(mesh_text(mesh))} · "
        f"{len(strategies)} anchor op(s)"
    )
    return (
        f"<details class='stageops'{' open' if open_ else ''}><summary>{summary}</summary>"
        f"{_batch_note(stage, first_split)}{table_html}</details>"
    )


def _pattern(module: str) -> tuple[str, ...]:
    """A module path with its numbered parts blanked: ``transformer.h.3.attn`` → ``("transformer", "h", "#",
    "attn")`` (ops of repeated blocks that chose alike share one row)."""
    return tuple("#" if part.isdigit() else part for part in module.split("."))


def merge_modules(modules: Sequence[str]) -> str:
    """``["transformer.h.0.attn", "transformer.h.1.attn", "transformer.h.2.attn"]`` → ``"transformer.h.0–2.attn"``
    (one numbered part that varies: its values as ranges); otherwise the distinct paths, comma-separated."""
    unique = list(dict.fromkeys(modules))
    if len(unique) == 1:
        return unique[0]
    split = [m.split(".") for m in unique]
    varying = {i for parts in split for i, p in enumerate(parts) if p != split[0][i]}
    if len({len(p) for p in split}) == 1 and len(varying) == 1 and all(p[next(iter(varying))].isdigit() for p in split):
        at = next(iter(varying))
        values = sorted(int(p[at]) for p in split)
        parts = list(split[0])
        parts[at] = ranges(values).replace(", ", ",")
        return ".".join(parts)
    return ", ".join(unique)


def _batch_note(stage: StagePlan, first_split: tuple[str, str, str, str] | None) -> str:
    inputs = getattr(stage, "inputs", {}) or {}
    stored = ", ".join(f"leaf {leaf}: {describe(spec)}" for leaf, spec in inputs.items())
    stored_text = f"Batch inputs as stored: {stored}. " if stored else ""
    if first_split is None:
        devices = int(stage.logical_mesh_shape[0]) * int(stage.logical_mesh_shape[1])
        idle = (
            f" Every anchor op is replicated on this {devices}-device mesh: each device computes the whole stage."
            if devices > 1 and all(parse_strategy(str(s))[2] == "replicated" for s in stage.strategies.values())
            else ""
        )
        return f"<p class='sub'>{e(stored_text)}No anchor op of this stage splits the batch.{e(idle)}</p>"
    node, op, module, name = first_split
    replicated = bool(inputs) and all(not any(spec) for spec in inputs.values())
    stored_text = stored_text.rstrip(". ") + (" (replicated). " if replicated else ". ") if stored_text else ""
    where = ", where it is first used" if replicated else ""
    return (
        f"<p class='batchnote'>{e(stored_text)}The batch is first split at <code>{e(op)}</code> "
        f"(<code>{e(module or node)}</code>, <code>{e(name)}</code>: {e(explain_strategy(op, name))}){where}; "
        "highlighted rows keep it split.</p>"
    )
