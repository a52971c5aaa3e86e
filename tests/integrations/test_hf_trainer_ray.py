"""``TorchparTrainer`` on the Ray runtime: 2 simulated hosts × 2 devices, DataParallel over both host actors, 12 steps
whose logs equal plain ``transformers.Trainer``'s within 1e-4, and each checkpoint holds the engine's shards written
by the host actors."""

from __future__ import annotations

import sys
from pathlib import Path

import transformers

import torchpar
from tests.runtime.ray_helpers import ray_cluster
from torchpar.integrations.transformers import TorchparTrainer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer_cases import causal_lm, datasets, logged_values, training_args  # noqa: E402

TOLERANCE = 1e-4


def test_data_parallel_over_two_host_actors_logs_what_plain_trainer_logs(tmp_path):
    train, evaluation = datasets()
    plain = transformers.Trainer(model=causal_lm("gpt2"), args=training_args(str(tmp_path / "plain"), max_steps=12,
                                                                             eval_steps=6),
                                 train_dataset=train, eval_dataset=evaluation)
    plain.train()
    with ray_cluster(num_hosts=2, devices_per_host=2):
        trainer = TorchparTrainer(model=causal_lm("gpt2"), train_dataset=train, eval_dataset=evaluation,
                                  args=training_args(str(tmp_path / "ours"), max_steps=12, eval_steps=6,
                                                     save_strategy="steps", save_steps=6),
                                  torchpar_method=torchpar.DataParallel())
        trainer.train()
        assert {w["rank"] for w in trainer.engine.describe_workers()} == {0, 1}
        trainer.close()
    ours, reference = logged_values(trainer.state.log_history), logged_values(plain.state.log_history)
    assert [(s, k) for s, k, _ in ours] == [(s, k) for s, k, _ in reference]
    assert max(abs(a - b) for (_, _, a), (_, _, b) in zip(ours, reference)) <= TOLERANCE
    for step in (6, 12):
        assert (tmp_path / "ours" / f"checkpoint-{step}" / "torchpar" / "index.json").exists()
        assert (tmp_path / "ours" / f"checkpoint-{step}" / "model.safetensors").exists()
