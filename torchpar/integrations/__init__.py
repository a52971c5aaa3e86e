"""Integrations with training frameworks users already run (each one's dependencies stay optional):
:mod:`torchpar.integrations.transformers` — ``TorchparTrainer``, a Hugging Face ``Trainer`` whose step is a
torchpar engine."""
