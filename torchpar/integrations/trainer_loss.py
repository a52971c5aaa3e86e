"""The loss plain ``transformers.Trainer`` trains under gradient accumulation, as a multiple of the whole batch's.

An update of ``n`` micro-batches ``b_1 … b_n`` gives every micro-batch the update's item count ``N`` (labels other
than -100) as ``num_items_in_batch``. Plain ``Trainer.training_step`` (transformers 5.24, ``trainer.py``) takes
``ℓ_m = compute_loss(b_m, num_items_in_batch=N)``, divides it by ``n`` unless the loss counts as "already scaled for
gradient accumulation", backpropagates it, and adds it to the logged running loss:

    logged and differentiated per update   = Σ_m c · ℓ_m,     c = 1 if scaled else 1/n
    scaled  = trainer.loss_is_scaled_for_ga if set, else
              (trainer.model_accepts_loss_kwargs and N is not None) or trainer.compute_loss_func is not None

``model_accepts_loss_kwargs`` is the model's ``accepts_loss_kwargs`` attribute, else whether its ``forward`` takes
``**kwargs`` (``Trainer.__init__``); ``compute_loss`` then passes ``N`` into the forward. The rule assumes such a
model divides a summed loss by ``N`` (the causal LMs' ``ForCausalLMLoss``): then ``Σ_m ℓ_m`` is the whole batch's
loss ``L``. Many models take ``**kwargs`` (transformers 5 forwards all do) and ignore ``N``:
``BertForSequenceClassification`` computes ``CrossEntropyLoss()`` (a mean) on each micro-batch, so ``ℓ_m ≈ L``
and plain Trainer logs and trains ``Σ_m ℓ_m ≈ n · L`` — ``n`` times the loss and ``n`` times the gradients (exactly,
for micro-batches with equal item counts: every sequence-classification batch). With SGD that is ``n`` times the step;
with Adam it barely changes the update (``ε`` and clipping aside), yet the logged loss is ``n`` times the mean.

:func:`trainer_loss_factor` is ``Σ_m c · ℓ_m / L`` for the four cases; :func:`loss_uses_item_count` tells a loss
that divides by ``N`` from one that ignores it, by evaluating it twice. ``TorchparTrainer`` (whose engine computes
``L`` on the whole update) multiplies its loss by the factor unless ``torchpar_loss="mean"``, and logs
:func:`loss_factor_warning` once.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    import transformers

log = logging.getLogger(__name__)

LOSS_MODES = ("trainer", "mean")
"""``TorchparTrainer(torchpar_loss=...)``: ``"trainer"`` trains and logs what plain ``Trainer`` does (the loss times
:func:`trainer_loss_factor`); ``"mean"`` the whole accumulated batch's loss as ``compute_loss`` defines it (the
batch's mean for a mean loss), whatever plain Trainer would do."""


def trainer_scales_for_accumulation(trainer: transformers.Trainer, num_items: torch.Tensor | int | None) -> bool:
    """Plain ``Trainer.training_step``'s test: does the loss ``compute_loss`` returns for a micro-batch count as
    already scaled for gradient accumulation (used as it is; else divided by the update's micro-batch count)?"""
    explicit = getattr(trainer, "loss_is_scaled_for_ga", None)  # transformers 5.24; None: decide as below
    if explicit is not None:
        return bool(explicit)
    return bool(trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None


def trainer_loss_factor(*, scaled: bool, uses_item_count: bool, micro_batches: int) -> float:
    """Plain Trainer's update loss ``Σ_m c · ℓ_m`` over the whole batch's ``L`` (module docstring): ``c = 1`` if
    ``scaled`` else ``1 / micro_batches``; ``Σ_m ℓ_m = L`` for a loss that divides by the update's item count
    (``uses_item_count``), ``micro_batches · L`` for a mean over each micro-batch. So 1, ``micro_batches`` (scaled
    mean: the sum of the micro-batch means) or ``1 / micro_batches`` (divided by the count, then by ``n`` again)."""
    if scaled == uses_item_count:
        return 1.0
    return float(micro_batches) if scaled else 1.0 / micro_batches


def loss_uses_item_count(
    trainer: transformers.Trainer, batch: Mapping[str, torch.Tensor], num_items: torch.Tensor | int
) -> bool:
    """Whether ``trainer.compute_loss`` depends on ``num_items_in_batch``: one row's loss with the count ``N`` and
    with ``2N``, in eval mode without gradients (no dropout draw, no BatchNorm statistics update, every module's mode
    restored); the next row while a row's loss is 0 or not finite, which cannot tell. A loss that divides by the
    count halves; one that ignores it stays the same bit for bit. No row that tells: taken to divide by it."""
    rows = next(iter(batch.values())).shape[0]
    model = trainer.model
    assert model is not None  # a Trainer that trains holds its model
    with _evaluating(model):
        for row in range(rows):
            inputs = {key: value[row : row + 1] for key, value in batch.items()}
            first, second = (  # without return_outputs, compute_loss returns the loss alone
                float(cast(torch.Tensor, trainer.compute_loss(model, dict(inputs), num_items_in_batch=count)))
                for count in (num_items, 2 * num_items)
            )
            if first != 0 and math.isfinite(first):
                return first != second
    log.info("torchpar: every row's loss is 0 or not finite; taking the loss to divide by num_items_in_batch")
    return True


def loss_factor_warning(trainer: transformers.Trainer, factor: float, micro_batches: int) -> str:
    """What ``TorchparTrainer`` logs once when plain Trainer trains ``factor`` × the batch's loss: why, and how to
    get the batch's loss instead."""
    model = type(trainer.model).__name__
    if factor > 1:
        return (
            f"torchpar: {model}'s training loss does not depend on num_items_in_batch (it is a mean over each "
            f"micro-batch), but {_scaling_reason(trainer)}; so plain transformers.Trainer does not divide each "
            f"micro-batch's loss by gradient_accumulation_steps ({micro_batches}) and trains and logs the sum of the "
            f"{micro_batches} micro-batch means: {micro_batches}x the batch's mean loss and {micro_batches}x its "
            "gradients. TorchparTrainer trains and logs the same, to match plain Trainer. For the batch's mean, pass "
            "TorchparTrainer(..., torchpar_loss='mean') (plain Trainer trains the mean after "
            "`trainer.model_accepts_loss_kwargs = False`)."
        )
    return (
        f"torchpar: {model}'s training loss is divided by num_items_in_batch (the whole update's item count), but "
        "trainer.loss_is_scaled_for_ga is False; so plain transformers.Trainer divides each micro-batch's loss by "
        f"gradient_accumulation_steps ({micro_batches}) as well and trains and logs 1/{micro_batches} of the batch's "
        "loss and gradients. TorchparTrainer trains and logs the same, to match plain Trainer. For the batch's loss, "
        "pass TorchparTrainer(..., torchpar_loss='mean') (or leave loss_is_scaled_for_ga at None)."
    )


def _scaling_reason(trainer: transformers.Trainer) -> str:
    """Why :func:`trainer_scales_for_accumulation` holds for ``trainer``, in words."""
    if getattr(trainer, "loss_is_scaled_for_ga", None) is not None:
        return "trainer.loss_is_scaled_for_ga is True"
    if trainer.compute_loss_func is not None:
        return "a compute_loss_func is set"
    return (
        "the model's forward takes **kwargs, so transformers assumes it divides its loss by num_items_in_batch "
        "(trainer.model_accepts_loss_kwargs is True)"
    )


@contextlib.contextmanager
def _evaluating(model: torch.nn.Module) -> Iterator[None]:
    modes = [(module, module.training) for module in model.modules()]
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for module, training in modes:
            module.training = training


__all__ = [
    "LOSS_MODES",
    "loss_factor_warning",
    "loss_uses_item_count",
    "trainer_loss_factor",
    "trainer_scales_for_accumulation",
]
