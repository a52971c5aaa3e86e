"""Plain ``Trainer``'s loss under gradient accumulation as a multiple of the whole batch's
(``torchpar/integrations/trainer_loss.py``), without training: the factor's four cases, and the probe that tells a loss
dividing by ``num_items_in_batch`` from one that ignores it."""

import types

import pytest
import torch

from torchpar.integrations.trainer_loss import (loss_uses_item_count, trainer_loss_factor,
                                                trainer_scales_for_accumulation)


def test_the_factor_of_each_case():
    assert trainer_loss_factor(scaled=True, uses_item_count=True, micro_batches=4) == 1  # GPT-2: Σ tokens / N
    assert trainer_loss_factor(scaled=False, uses_item_count=False, micro_batches=4) == 1  # means ÷ 4, added
    assert trainer_loss_factor(scaled=True, uses_item_count=False, micro_batches=4) == 4  # means added (BERT)
    assert trainer_loss_factor(scaled=False, uses_item_count=True, micro_batches=4) == 0.25  # ÷ N, then ÷ 4


def test_scaled_follows_plain_trainers_rule():
    def trainer(accepts, func=None, explicit=None):
        return types.SimpleNamespace(model_accepts_loss_kwargs=accepts, compute_loss_func=func,
                                     loss_is_scaled_for_ga=explicit)

    assert trainer_scales_for_accumulation(trainer(True), torch.tensor(7))
    assert not trainer_scales_for_accumulation(trainer(True), None)  # no labels counted
    assert not trainer_scales_for_accumulation(trainer(False), torch.tensor(7))
    assert trainer_scales_for_accumulation(trainer(False, func=len), None)
    assert not trainer_scales_for_accumulation(trainer(True, explicit=False), torch.tensor(7))


class Regression(torch.nn.Module):
    """``forward(x, labels, **kwargs)``: the squared error summed over ``num_items_in_batch`` or (``mean``) its mean;
    dropout and a BatchNorm, which the probe must neither draw from nor update."""

    def __init__(self, mean: bool):
        super().__init__()
        self.mean, self.norm, self.linear = mean, torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, x, labels, num_items_in_batch=None, **kwargs):
        error = (self.dropout(self.linear(self.norm(x))).squeeze(-1) - labels) ** 2
        return error.mean() if self.mean or num_items_in_batch is None else error.sum() / num_items_in_batch


@pytest.mark.parametrize("mean", [True, False])
def test_the_probe_tells_a_mean_from_a_loss_divided_by_the_count(mean):
    def compute_loss(model, inputs, num_items_in_batch):  # Trainer.compute_loss's call, for a model taking kwargs
        return model(**inputs, num_items_in_batch=num_items_in_batch)

    model = Regression(mean).train()
    trainer = types.SimpleNamespace(model=model, compute_loss=compute_loss)
    batch = {"x": torch.randn(4, 3), "labels": torch.randn(4)}
    batch["labels"][0] = float("nan")  # the first row cannot tell: the probe goes on to the next
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert loss_uses_item_count(trainer, batch, torch.tensor(4)) is not mean
    assert model.training and all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats untouched
    assert torch.equal(rng, torch.get_rng_state())  # no dropout draw
