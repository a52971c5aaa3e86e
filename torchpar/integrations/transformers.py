"""``TorchparTrainer``: a Hugging Face ``transformers.Trainer`` whose training step is a torchpar engine.

A Trainer user changes one line (``Trainer`` → ``TorchparTrainer``, plus ``torchpar_method=`` if more than one
device should train) and keeps the Trainer's data loading, LR schedules, logging, evaluation, callbacks,
checkpoints and resumption. Why a subclass: the Trainer's loop (``Trainer._run_epoch``) already calls one
overridable method per concern, and overriding those is the least invasive door transformers offers — a
callback cannot replace the backward or the optimizer step, and accelerate's plugins (DeepSpeed, FSDP) assume
torch's own autograd. The overridden methods, and what each does instead:

========================================  =======================================================================
``training_step``                         collects the update's ``gradient_accumulation_steps`` micro-batches; on
                                          the last one runs ``engine.step`` on their concatenation (the engine
                                          built on the first update) and returns its loss; the earlier
                                          micro-batches return 0, so the Trainer's running loss sums to the
                                          engine's whole-batch loss per update, as plain Trainer's does; the
                                          loss is scaled as plain Trainer scales it (:mod:`.trainer_loss`)
``_clip_grad_norm`` / ``_get_grad_norm``  the engine's pre-clip gradient norm (the engine clips to
                                          ``max_grad_norm`` inside its step); no torch gradient exists
``prediction_step``                       the engine's eval-mode forward (``compute_loss`` with labels)
``save_model``                            the engine's weights copied into the torch model, then the Trainer's
                                          ``save_pretrained`` directory
``_save_optimizer_and_scheduler``         the engine's sharded checkpoint (``<checkpoint>/torchpar``) and the
                                          scheduler's state
``_load_optimizer_and_scheduler``         the scheduler's state; the engine loads ``<checkpoint>/torchpar`` when it
                                          is built (a plain Trainer checkpoint's ``optimizer.pt`` also resumes)
``log``                                   adds the engine's tokens/s and step time to training logs
========================================  =======================================================================

The Trainer's own ``optimizer.step()`` still runs and changes nothing (no parameter has a gradient); its
scheduler writes the learning rate into ``optimizer.param_groups``, which the engine reads every step (the engine is
compiled with ``grad_stand_ins=False`` for that ``optimizer.step()``). The torch model holds the engine's weights
whenever code looks at it (:mod:`torchpar.engine.model_link`): a callback reading them mid-training sees the current
ones.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import logging
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch

try:
    import transformers
    from transformers.debug_utils import DebugOption
except ImportError as error:  # pragma: no cover (transformers is a dependency; accelerate below is the extra)
    raise ImportError("torchpar.integrations.transformers needs transformers: pip install 'transformers>=5'") from error

import torchpar
from torchpar.engine import batches
from torchpar.integrations.trainer_loss import (
    LOSS_MODES,
    loss_factor_warning,
    loss_uses_item_count,
    trainer_loss_factor,
    trainer_scales_for_accumulation,
)
from torchpar.methods import DataParallel, Method
from torchpar.planner.plan import Plan

if TYPE_CHECKING:
    from torchpar.api import Engine

log = logging.getLogger(__name__)

ENGINE_CHECKPOINT_DIR = "torchpar"
"""The engine's sharded checkpoint inside a Trainer checkpoint directory (``checkpoint-N/torchpar``)."""
SCHEDULER_NAME = "scheduler.pt"
"""The Trainer's scheduler-state file in a checkpoint directory (``transformers.trainer.SCHEDULER_NAME``)."""

ITEM_COUNT_KEY = "torchpar_num_items_in_batch"
"""The batch leaf carrying the Trainer's ``num_items_in_batch`` into the engine's step (:func:`with_item_count`)."""

MAPPED_OPTIONS = {
    "grad_clip_norm": "max_grad_norm",
    "seed": "seed",
    "mixed_precision": "bf16 / fp16",
    "step_fn": "the Trainer's compute_loss",
    "forward_fn": "the Trainer's compute_loss",
    "loss_fn": "the Trainer's compute_loss",
    "matmul_precision": "tf32",
}
"""``compile`` options the Trainer's arguments set (option → the ``TrainingArguments`` field that sets it)."""

PAD_VALUES = {
    "input_ids": None,
    "attention_mask": 0,
    "token_type_ids": 0,
    "labels": -100,
    "decoder_input_ids": None,
    "decoder_attention_mask": 0,
}
"""Fill values for concatenating micro-batches padded to different lengths (``None``: the model's
``pad_token_id``, else 0). Right padding with attention mask 0 and label -100 changes no loss or gradient."""


def refused_arguments(args: transformers.TrainingArguments) -> list[str]:
    """The ``TrainingArguments`` (and Trainer features) torchpar cannot honour, each with what to do instead."""
    refused = []
    if args.deepspeed:
        refused.append(
            "deepspeed: torchpar shards the model itself; pass torchpar_method=torchpar.Zero3Parallel() "
            "(or Zero2Parallel / ShardParallel / PipeshardParallel)"
        )
    if args.fsdp:
        refused.append("fsdp: torchpar shards the model itself; pass torchpar_method=torchpar.Zero3Parallel()")
    if getattr(args, "parallelism_config", None) is not None:
        refused.append("parallelism_config: torchpar plans the parallelism; pass torchpar_method=...")
    if args.torch_compile:
        refused.append("torch_compile: the engine's step is already one XLA program")
    if getattr(args, "gradient_checkpointing", False) or getattr(args, "activation_checkpointing", False):
        refused.append(
            "gradient_checkpointing / activation_checkpointing: pass torchpar_options={'remat': "
            "'layers'} (or 'selective' / 'auto')"
        )
    if args.use_liger_kernel:
        refused.append("use_liger_kernel: Liger's Triton kernels do not lower to JAX")
    if args.neftune_noise_alpha is not None:
        refused.append("neftune_noise_alpha: NEFTune adds noise with a forward hook, which torchpar does not run")
    if args.auto_find_batch_size:
        refused.append("auto_find_batch_size: torchpar plans memory itself; set per_device_train_batch_size")
    if args.bf16_full_eval or args.fp16_full_eval:
        refused.append("bf16_full_eval / fp16_full_eval: evaluation runs under the engine's mixed_precision")
    if DebugOption.UNDERFLOW_OVERFLOW in (args.debug or []):
        refused.append("debug='underflow_overflow': its detector uses forward hooks, which torchpar does not run")
    return refused


def torch_side_arguments(args: transformers.TrainingArguments) -> transformers.TrainingArguments:
    """The ``TrainingArguments`` the Trainer's own machinery (accelerate, device placement) gets: ``args`` itself, or
    a copy without mixed precision (the engine casts; accelerate's autocast must not wrap the torch forward too)
    and on the CPU (the torch model only holds the initial weights and the batches are handed to the engine: no
    copy of the model on the GPUs the engine uses, no ``nn.DataParallel`` wrapping for several of them)."""
    if not (args.bf16 or args.fp16) and args.device.type == "cpu":
        return args
    torch_side = copy.copy(args)
    torch_side.bf16 = torch_side.fp16 = False
    torch_side.mixed_precision = "no"
    if args.device.type != "cpu":
        torch_side.use_cpu = True
        torch_side.__dict__.pop("_setup_devices", None)  # a cached_property: recomputed for the CPU
    return torch_side


def merge_micro_batches(
    micro_batches: Sequence[Mapping[str, object]], pad_token_id: int | None = None
) -> dict[str, torch.Tensor]:
    """One batch of ``micro_batches`` concatenated along dim 0, in order. Leaves of different sizes past dim 0
    (a collator that pads each micro-batch to its own longest sequence) are right-padded to the longest with
    :data:`PAD_VALUES`; a leaf torchpar cannot pad that way raises naming it."""
    keys = list(micro_batches[0])
    for index, micro in enumerate(micro_batches[1:], start=1):
        if list(micro) != keys:
            raise ValueError(
                f"micro-batch {index} of the update has keys {list(micro)}, the first has {keys}: the "
                "data collator must give every batch the same fields"
            )
    merged = {}
    for key in keys:
        fields = [micro[key] for micro in micro_batches]
        if not all(isinstance(leaf, torch.Tensor) for leaf in fields):
            raise TypeError(
                f"batch field {key!r} is a {type(fields[0]).__name__}, not a tensor: torchpar trains on "
                "tensor batches (return tensors from the data collator)"
            )
        leaves = cast("list[torch.Tensor]", fields)  # every one a tensor: checked above
        if len({leaf.shape[1:] for leaf in leaves}) > 1:
            leaves = _right_padded(key, leaves, pad_token_id)
        merged[key] = torch.cat(leaves) if len(leaves) > 1 else leaves[0]
    return merged


def _right_padded(key: str, leaves: list[torch.Tensor], pad_token_id: int | None) -> list[torch.Tensor]:
    if key not in PAD_VALUES or any(leaf.dim() != 2 for leaf in leaves):
        raise ValueError(
            f"batch field {key!r} has shapes {[list(leaf.shape) for leaf in leaves]} in the update's micro-batches "
            "and torchpar does not know how to pad it: pad every batch to one length in the data collator "
            "(padding='max_length', or pad_to_multiple_of) — each new shape also compiles the step once more"
        )
    fill = PAD_VALUES[key] if PAD_VALUES[key] is not None else (pad_token_id or 0)
    length = max(leaf.shape[1] for leaf in leaves)
    return [torch.nn.functional.pad(leaf, (0, length - leaf.shape[1]), value=fill) for leaf in leaves]


def with_item_count(batch: dict[str, torch.Tensor], num_items: torch.Tensor | int | None) -> dict[str, torch.Tensor]:
    """``batch`` with the Trainer's ``num_items_in_batch`` for it (the update's count of label items, by which the
    Trainer divides a summed loss) as the leaf :data:`ITEM_COUNT_KEY`: ``num_items`` spread over the rows as whole
    numbers (row ``i`` holds ``N // rows`` plus one for ``i < N mod rows``), so micro-batches and devices each hold
    a share and the loss's divisor, their sum, is ``N`` exactly however the rows are split (torchpar combines a
    loss ``num / den`` over micro-batches as ``Σ num / Σ den``). ``batch`` unchanged for ``None``."""
    if num_items is None:
        return batch
    total = int(num_items.item() if isinstance(num_items, torch.Tensor) else num_items)
    rows = next(iter(batch.values())).shape[0]
    share = torch.full((rows,), total // rows, dtype=torch.int64)
    share[: total % rows] += 1
    return {**batch, ITEM_COUNT_KEY: share}


def without_item_count(batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """The model's inputs and the Trainer's ``num_items_in_batch`` (``None`` if the batch has no
    :data:`ITEM_COUNT_KEY`)."""
    inputs = dict(batch)
    share = inputs.pop(ITEM_COUNT_KEY, None)
    return inputs, None if share is None else share.sum()


def _engine_method(method: Method | Plan | None, accumulation: int) -> Method | Plan | None:
    """The method the engine compiles: ``gradient_accumulation_steps`` becomes the micro-batch count of a method
    left at one micro-batch (one device: ``DataParallel`` on a 1×1 mesh, which takes micro-batches); a method or
    plan with its own micro-batch count keeps it (the step is the whole batch either way)."""
    if accumulation == 1 or isinstance(method, Plan):
        return method
    if method is None:
        return DataParallel(mesh_shape=(1, 1), num_micro_batches=accumulation)
    if getattr(method, "num_micro_batches", 1) == 1:
        return dataclasses.replace(method, num_micro_batches=accumulation)
    return method


def _unwrapped_optimizer(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    while isinstance(inner := getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = inner
    return optimizer


class TorchparTrainer(transformers.Trainer):
    """``transformers.Trainer`` with the training step, evaluation forward and checkpoints run by a torchpar engine.

    Same constructor as ``Trainer`` plus:

    - ``torchpar_method``: ``None`` (one device, the default), any torchpar method (``torchpar.DataParallel()``,
      ``torchpar.PipeshardParallel(...)``, ...) or a saved :class:`~torchpar.planner.plan.Plan`.
    - ``torchpar_options``: further :func:`torchpar.compile` keywords (``remat``, ``spmd``, ``on_nonfinite``,
      ``log_every``, ``profile``, ...). Those the ``TrainingArguments`` set are refused here (:data:`MAPPED_OPTIONS`).
    - ``torchpar_loss``: ``"trainer"`` (the default) trains and logs what plain ``Trainer`` does, including its
      scaling of a loss that ignores ``num_items_in_batch`` under gradient accumulation (:mod:`.trainer_loss`; a
      warning says so once); ``"mean"`` trains the whole accumulated batch's loss.

    What the ``TrainingArguments`` mean here: ``per_device_train_batch_size`` is the batch this process feeds per
    micro-batch, which the method splits over its devices (torchpar's "global" batch: one process drives all the
    devices); ``gradient_accumulation_steps`` is the engine's micro-batch count, so an update is one engine step
    on the whole accumulated batch — the loss is the whole batch's (token-weighted for token losses, as the
    Trainer's ``num_items_in_batch``) times plain Trainer's factor for it (:mod:`.trainer_loss`); ``max_grad_norm``
    → ``grad_clip_norm``; ``bf16`` / ``fp16`` → ``mixed_precision``; ``tf32`` → ``matmul_precision`` (``"high"`` /
    ``"highest"``); ``seed`` → the engine's PRNG seed (dropout). Learning rate, schedule, warmup, weight decay,
    optimizer choice (torch optimizers), logging, evaluation, saving, ``save_total_limit``, ``max_steps`` /
    ``num_train_epochs`` and ``dataloader_drop_last`` are the Trainer's own. Arguments torchpar cannot honour
    (:func:`refused_arguments`) raise a ``ValueError`` naming them. The engine is built on the first update of
    ``train()`` and kept for later ``train`` / ``evaluate`` calls (``trainer.engine``); ``trainer.close()`` frees its
    workers.
    """

    def __init__(
        self,
        *args: Any,
        torchpar_method: Method | Plan | None = None,
        torchpar_options: Mapping[str, Any] | None = None,
        torchpar_loss: str = "trainer",
        **kwargs: Any,
    ):
        if importlib.util.find_spec("accelerate") is None:
            raise ImportError(
                "transformers.Trainer needs accelerate: pip install 'torchpar[trainer]' (or 'accelerate>=1.1')"
            )
        if torchpar_method is not None and not isinstance(torchpar_method, Method | Plan):
            raise TypeError(f"torchpar_method must be None, a torchpar method or a Plan, got {torchpar_method!r}")
        if torchpar_loss not in LOSS_MODES:
            raise ValueError(
                f"torchpar_loss must be one of {LOSS_MODES}, got {torchpar_loss!r}: 'trainer' trains "
                "and logs what plain transformers.Trainer does, 'mean' the whole accumulated batch's loss"
            )
        options = dict(torchpar_options or {})
        mapped = sorted(set(options) & set(MAPPED_OPTIONS))
        if mapped:
            raise ValueError(
                "torchpar_options "
                + ", ".join(f"{name!r} is set by {MAPPED_OPTIONS[name]}" for name in mapped)
                + ": set those TrainingArguments instead"
            )
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if training_args is None:
            raise ValueError(
                "TorchparTrainer needs args=TrainingArguments(...): its output_dir, batch size and "
                "schedule decide what the engine trains"
            )
        refused = refused_arguments(training_args)
        if refused:
            raise ValueError("TorchparTrainer cannot honour these TrainingArguments: " + "; ".join(refused))
        self._mixed_precision = "bf16" if training_args.bf16 else "fp16" if training_args.fp16 else None
        self._matmul_precision = None if training_args.tf32 is None else ("high" if training_args.tf32 else "highest")
        torch_side = torch_side_arguments(training_args)
        if torch_side is not training_args:
            if len(args) > 1:
                args = (args[0], torch_side, *args[2:])
            else:
                kwargs["args"] = torch_side
        self.torchpar_method = torchpar_method
        self.torchpar_options = options
        self.torchpar_loss = torchpar_loss
        self._loss_factor = 1.0
        self._uses_item_count: bool | None = None
        self._warned_loss_factor = False
        self.engine: Engine | None = None
        self._pending: list[dict[str, object]] = []
        self._grad_norm: float | None = None
        self._engine_checkpoint: str | None = None
        self._warned_torch_eval = False
        self._train_structure: str | None = None

        super().__init__(*args, **kwargs)

    # --- the training step ------------------------------------------------------------------------------------

    def training_step(
        self,
        model: torch.nn.Module,
        inputs: Mapping[str, object],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        """Collect the update's micro-batches; on the last one run the engine's step on all of them and return its
        loss (the earlier ones return 0). The loss is the Trainer's: ``compute_loss`` with the Trainer's
        ``num_items_in_batch`` for the whole update (:func:`with_item_count`), so a summed loss is divided by the
        count the Trainer divides by, times plain Trainer's factor for the update (:meth:`_update_loss_factor`)."""
        self._pending.append(dict(inputs))
        if len(self._pending) < self.current_gradient_accumulation_steps:
            return torch.zeros((), device=self.args.device)
        micro_batches = len(self._pending)
        batch = merge_micro_batches(self._pending, getattr(getattr(self.model, "config", None), "pad_token_id", None))
        self._pending = []
        self._loss_factor = self._update_loss_factor(batch, num_items_in_batch, micro_batches)
        batch = with_item_count(batch, num_items_in_batch)
        assert self.model is not None  # a Trainer that trains holds its model
        self.model.train()  # the Trainer's training mode (evaluate() leaves the model in eval mode)
        self._check_rows(batch)
        engine = self.engine or self._build_engine(batch)
        loss = cast(torch.Tensor, engine.step(batch))  # the step_fn (_loss_of) returns the loss alone, no aux
        self._grad_norm = engine.last_grad_norm
        return loss.to(device=self.args.device, dtype=torch.float32)

    def _update_loss_factor(
        self, batch: Mapping[str, torch.Tensor], num_items: torch.Tensor | int | None, micro_batches: int
    ) -> float:
        """The factor of the whole batch's loss that the engine trains for this update: plain Trainer's
        (:mod:`.trainer_loss`) under ``torchpar_loss="trainer"``, warning once when it is not 1; 1 under ``"mean"``.
        The engine captures ``step_fn`` once per batch signature, and an update's rows fix its micro-batch count (only
        an epoch's last update is shorter), so each signature's graph bakes in its own factor."""
        if self.torchpar_loss == "mean" or micro_batches == 1:
            return 1.0
        if num_items is not None and self._uses_item_count is None:
            self._uses_item_count = loss_uses_item_count(self, batch, num_items)
        factor = trainer_loss_factor(
            scaled=trainer_scales_for_accumulation(self, num_items),
            uses_item_count=num_items is not None and bool(self._uses_item_count),
            micro_batches=micro_batches,
        )
        if factor != 1 and not self._warned_loss_factor:
            log.warning("%s", loss_factor_warning(self, factor, micro_batches))
            self._warned_loss_factor = True
        return factor

    def _clip_grad_norm(self, model: torch.nn.Module) -> float | None:
        """The engine's gradient norm before clipping (the engine clipped to ``max_grad_norm`` in its step)."""
        return self._grad_norm

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: float | None = None) -> float | None:
        return self._grad_norm if grad_norm is None else grad_norm

    def _build_engine(self, batch: dict[str, torch.Tensor]) -> Engine:
        """Compile the engine on the first update's batch, and load the checkpoint being resumed from."""
        args = self.args
        method = _engine_method(self.torchpar_method, args.gradient_accumulation_steps)
        clip = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        log.info(
            "torchpar: compiling the training step (method %s, %d micro-batch(es) per update)",
            type(method).__name__ if method is not None else "one device",
            getattr(method, "num_micro_batches", 1),
        )
        self._train_structure = batches.signature(batch)[0]
        assert self.optimizer is not None  # the Trainer creates it before its first step
        self.engine = torchpar.compile(
            self.model,
            _unwrapped_optimizer(self.optimizer),
            example_batch=batch,
            method=method,
            step_fn=self._loss_of,
            forward_fn=self._eval_outputs_of,
            grad_clip_norm=clip,
            seed=args.seed,
            mixed_precision=self._mixed_precision,
            matmul_precision=self._matmul_precision,
            grad_stand_ins=False,  # the Trainer's own optimizer.step() runs after the engine's (and changes nothing)
            **self.torchpar_options,
        )
        if self._engine_checkpoint is not None:
            self.engine.load(self._engine_checkpoint)
            self._engine_checkpoint = None
        return self.engine

    def _loss_of(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The training loss as the Trainer computes it (label smoothing, ``compute_loss_func``, a subclass's
        ``compute_loss``; ``num_items_in_batch`` from :data:`ITEM_COUNT_KEY`), times the update's factor
        (:meth:`_update_loss_factor`, a constant of the captured graph): the engine's ``step_fn``."""
        inputs, num_items = without_item_count(batch)
        # without return_outputs, compute_loss returns the loss alone
        loss = cast(torch.Tensor, self.compute_loss(model, inputs, num_items_in_batch=num_items))
        return loss if self._loss_factor == 1 else loss * self._loss_factor

    def _eval_outputs_of(self, model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> dict[str, object]:
        """The eval forward: ``{"loss", "outputs"}`` from ``compute_loss`` when the batch has every label,
        else ``{"outputs"}`` (the engine's ``forward_fn``)."""
        inputs, num_items = without_item_count(batch)
        if self.label_names and all(inputs.get(name) is not None for name in self.label_names):
            loss, outputs = self.compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items)
            return {"loss": loss, "outputs": outputs}
        return {"outputs": model(**inputs)}

    def _check_rows(self, batch: Mapping[str, torch.Tensor]) -> None:
        if self.engine is not None:
            micro = self.engine.plan.num_micro_batches
        else:
            micro = getattr(
                _engine_method(self.torchpar_method, self.args.gradient_accumulation_steps), "num_micro_batches", 1
            )
        if micro == "auto":  # the count is searched among those that divide the first batch's rows
            return
        rows = next(iter(batch.values())).shape[0]
        if rows % micro:
            raise ValueError(
                f"this update has {rows} rows, which the engine's {micro} micro-batches cannot split evenly (an "
                "epoch's smaller last batch?): set dataloader_drop_last=True, or a per_device_train_batch_size and "
                "gradient_accumulation_steps that divide the dataset"
            )

    def sync_to_torch(self) -> None:
        """Copy the engine's weights and optimizer state into ``trainer.model`` and its optimizer."""
        if self.engine is not None:
            self.engine.sync_to_torch()

    def close(self) -> None:
        """Free the engine's workers (Ray actors and what they hold); a later ``train`` compiles a new engine."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def train(self, *args: Any, **kwargs: Any) -> transformers.trainer_utils.TrainOutput:
        """``Trainer.train``; afterwards ``trainer.model`` holds the trained weights."""
        self._pending = []
        try:
            return super().train(*args, **kwargs)
        finally:
            self._pending = []
            self.sync_to_torch()

    # --- evaluation -------------------------------------------------------------------------------------------

    def prediction_step(
        self,
        model: torch.nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[Any, Any, Any]:
        """``Trainer.prediction_step`` through the engine's eval-mode forward. Before the engine exists the torch
        model holds the current weights and the Trainer evaluates it itself; so it does for a batch whose fields
        differ from the training batch's (the engine's weights copied back first)."""
        if self.engine is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = dict(inputs)
        has_labels = bool(self.label_names) and all(inputs.get(name) is not None for name in self.label_names)
        counted = with_item_count(
            inputs, self._get_num_items_in_batch([inputs], self.args.device) if has_labels else None
        )
        if batches.signature(counted)[0] != self._train_structure:
            if not self._warned_torch_eval:
                log.warning(
                    "torchpar: the eval batch's fields %s differ from the training batch's: evaluating with "
                    "torch on this process (weights copied from the engine)",
                    sorted(inputs),
                )
                self._warned_torch_eval = True
            self.engine.sync_to_torch()
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        if ignore_keys is None:
            config = getattr(self.model, "config", None)
            ignore_keys = getattr(config, "keys_to_ignore_at_inference", ["cache"]) if config is not None else []
        labels = None
        if has_labels:
            labels = tuple(inputs[name].detach() for name in self.label_names)
            labels = labels[0] if len(labels) == 1 else labels
        result = self.engine.forward(counted)
        loss = result["loss"].detach().mean() if "loss" in result else None
        if prediction_loss_only:
            return loss, None, None
        outputs = result["outputs"]
        if isinstance(outputs, Mapping):
            logits = tuple(v for k, v in outputs.items() if k not in [*ignore_keys, "loss"])
        else:
            logits = tuple(outputs[1:] if has_labels else outputs)
        logits = logits[0] if len(logits) == 1 else logits
        return loss, logits, labels

    # --- checkpoints ------------------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` with the engine's weights: a ``save_pretrained`` directory plain transformers
        loads (``AutoModel*.from_pretrained(output_dir)``)."""
        self.sync_to_torch()
        super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """The engine's sharded checkpoint (state, optimizer state, step count, PRNG position) in
        ``output_dir/torchpar``, and the scheduler's state in ``scheduler.pt``."""
        if self.engine is None:
            super()._save_optimizer_and_scheduler(output_dir)
            return
        self.engine.save(os.path.join(output_dir, ENGINE_CHECKPOINT_DIR))
        if self.args.should_save:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # torch warns that the scheduler's state includes the optimizer's
                assert self.lr_scheduler is not None  # created with the optimizer, before the first step
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        """Resume: the scheduler's state now, the engine's checkpoint when the engine is built (at once if it
        exists). A checkpoint of plain ``Trainer`` (``optimizer.pt``, no ``torchpar/``) resumes through the torch
        optimizer, which the engine is compiled from."""
        if checkpoint is None:
            return
        engine_checkpoint = os.path.join(checkpoint, ENGINE_CHECKPOINT_DIR)
        if not os.path.isdir(engine_checkpoint):
            super()._load_optimizer_and_scheduler(checkpoint)
            if self.engine is not None:  # the torch objects hold the checkpoint: compile again from them
                self.close()
            return
        scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler_file):
            assert self.lr_scheduler is not None  # train() creates it before it resumes
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
        if self.engine is not None:
            self.engine.load(engine_checkpoint)
        else:
            self._engine_checkpoint = engine_checkpoint

    def _load_best_model(self) -> None:
        """``load_best_model_at_end``: the Trainer loads the best checkpoint's weights into the torch model; the
        engine loads that checkpoint's state too."""
        super()._load_best_model()
        best = self.state.best_model_checkpoint
        if self.engine is not None and best is not None:
            engine_checkpoint = os.path.join(best, ENGINE_CHECKPOINT_DIR)
            if os.path.isdir(engine_checkpoint):
                self.engine.load(engine_checkpoint)

    # --- logs -------------------------------------------------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """``Trainer.log``, with the engine's tokens/s and step time (its last step) added to training logs."""
        if self.engine is not None and "loss" in logs:
            metrics = self.engine.last_metrics
            if metrics is not None:
                if metrics.tokens_per_s is not None:
                    logs["torchpar_tokens_per_s"] = metrics.tokens_per_s
                logs["torchpar_step_time_s"] = metrics.step_time_s
        super().log(logs, start_time)
