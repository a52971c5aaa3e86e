"""``TorchparTrainer`` trains what plain ``transformers.Trainer`` trains (issue 33's acceptance).

Tiny GPT-2 and Llama (dropout 0), 30 steps, gradient accumulation 2, cosine schedule with 5 warmup steps, clipping
at 1.0, logs every 5 steps and evaluation every 10: every logged train loss, ``grad_norm``, learning rate and eval
loss equal plain ``Trainer``'s on the same seed and data within 1e-4, on one device and on 4 fake devices with
DataParallel and with a 2-stage pipeline. A run killed after its checkpoint at step 20 and resumed in a new process
logs steps 21–30 bit for bit as the uninterrupted run; ``save_model`` writes a directory plain transformers loads;
a BERT sequence classifier trains and evaluates with ``compute_metrics``; its mean loss, which plain Trainer scales
by the accumulation steps, is scaled alike by default (warning once), the batch's mean with ``torchpar_loss="mean"``.
Unsupported arguments raise naming themselves."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers

import torchpar
from torchpar.integrations.transformers import (ITEM_COUNT_KEY, TorchparTrainer, merge_micro_batches,
                                                with_item_count, without_item_count)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_trainer_cases import METHODS, causal_lm, datasets, logged_values, training_args  # noqa: E402

TOLERANCE = 1e-4
RESUME_SCRIPT = Path(__file__).resolve().parent / "hf_trainer_resume.py"


@pytest.fixture(scope="module", autouse=True)
def four_devices():
    """The acceptance's 4 fake devices (of the session's 8, given back afterwards)."""
    torchpar.init(cluster="local", num_devices=4)
    yield
    torchpar.init(cluster="local", num_devices=8)


@pytest.fixture(scope="module")
def plain_trainer_logs(tmp_path_factory):
    """Plain ``transformers.Trainer``'s logged values per model family (computed once)."""
    cache = {}

    def get(family: str) -> list[tuple[int, str, float]]:
        if family not in cache:
            train, evaluation = datasets()
            trainer = transformers.Trainer(model=causal_lm(family), train_dataset=train, eval_dataset=evaluation,
                                           args=training_args(str(tmp_path_factory.mktemp("plain"))))
            trainer.train()
            cache[family] = logged_values(trainer.state.log_history)
        return cache[family]

    return get


def assert_logs_match(ours: list[tuple[int, str, float]], reference: list[tuple[int, str, float]],
                      tolerance: float = TOLERANCE) -> None:
    assert [(step, key) for step, key, _ in ours] == [(step, key) for step, key, _ in reference]
    table = "\n".join(f"step {step:2d} {key:13s} torchpar {mine:.8f} plain {theirs:.8f}"
                      for (step, key, mine), (_, _, theirs) in zip(ours, reference))
    worst = max(abs(mine - theirs) for (_, _, mine), (_, _, theirs) in zip(ours, reference))
    assert worst <= tolerance, f"largest difference {worst:.3g} > {tolerance}:\n{table}"


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_logs_equal_plain_trainer(family, method, plain_trainer_logs, tmp_path):
    train, evaluation = datasets()
    trainer = TorchparTrainer(model=causal_lm(family), args=training_args(str(tmp_path)), train_dataset=train,
                              eval_dataset=evaluation, torchpar_method=METHODS[method]())
    trainer.train()
    try:
        history = trainer.state.log_history
        assert_logs_match(logged_values(history), plain_trainer_logs(family))
        # gradient accumulation became the engine's micro-batches; the logs carry the engine's throughput
        assert trainer.engine.plan.num_micro_batches == 2
        assert all(entry["torchpar_tokens_per_s"] > 0 for entry in history if "loss" in entry)
        assert trainer.engine.plan.method == {"one_device": "data_parallel", "data_parallel": "data_parallel",
                                              "pipeline": "pipeshard"}[method]
        # after train() the torch model holds the engine's weights
        exported = trainer.engine.export_torch_state_dict()
        for name, value in trainer.model.state_dict().items():
            assert torch.equal(value, exported[name]), name
    finally:
        trainer.close()


def _run(mode: str, output_dir: Path) -> list[dict]:
    completed = subprocess.run([sys.executable, str(RESUME_SCRIPT), mode, str(output_dir)], capture_output=True,
                               text=True, timeout=600)
    assert completed.returncode == 0, completed.stderr[-4000:]
    history = output_dir / "history.json"
    return json.loads(history.read_text()) if history.exists() else []


def test_a_killed_run_resumes_bit_for_bit_in_a_new_process(tmp_path):
    sys.path.insert(0, str(RESUME_SCRIPT.parent))
    import hf_trainer_resume

    full_dir = tmp_path / "full"
    train, evaluation = datasets()
    torchpar.init(cluster="local", num_devices=1)  # as the script's processes
    try:
        trainer = TorchparTrainer(model=causal_lm("gpt2"), args=hf_trainer_resume.run_args(str(full_dir)),
                                  train_dataset=train, eval_dataset=evaluation)
        trainer.train()
        trainer.save_model(str(full_dir / "final"))
        engine_weights = trainer.engine.export_torch_state_dict()
        trainer.close()
    finally:
        torchpar.init(cluster="local", num_devices=4)
    full = [e for e in trainer.state.log_history if "loss" in e or "eval_loss" in e]

    resumed_dir = tmp_path / "resumed"
    assert _run("killed", resumed_dir) == []  # killed before writing its history
    assert sorted(p.name for p in resumed_dir.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-20"]
    assert (resumed_dir / "checkpoint-20" / "torchpar" / "index.json").exists()
    resumed = [e for e in _run("resume", resumed_dir) if "loss" in e or "eval_loss" in e]

    after = [e for e in full if e["step"] > hf_trainer_resume.KILL_AT]
    assert len(after) == 11  # steps 21–30 logged, and the evaluation at 30
    assert [e["step"] for e in after] == [e["step"] for e in resumed if e["step"] > hf_trainer_resume.KILL_AT]
    for mine, theirs in zip(after, [e for e in resumed if e["step"] > hf_trainer_resume.KILL_AT]):
        for key in ("loss", "grad_norm", "learning_rate", "eval_loss"):
            assert mine.get(key) == theirs.get(key), (mine["step"], key, mine.get(key), theirs.get(key))
    # save_total_limit=2 kept the last two checkpoints
    assert sorted(p.name for p in resumed_dir.glob("checkpoint-*")) == ["checkpoint-20", "checkpoint-30"]

    # save_model wrote what plain transformers loads: the engine's weights, equal in both runs
    full_model = transformers.AutoModelForCausalLM.from_pretrained(full_dir / "final")
    resumed_model = transformers.AutoModelForCausalLM.from_pretrained(resumed_dir / "final")
    for name, value in full_model.state_dict().items():
        assert torch.equal(value, engine_weights[name]), name
        assert torch.equal(value, resumed_model.state_dict()[name]), name


class Parity(torch.utils.data.Dataset):
    """Sequences whose label is whether their first token is in the lower half of the vocabulary."""

    def __init__(self, n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, 64, (n, 16), generator=generator)
        self.labels = (self.ids[:, 0] < 32).long()

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "attention_mask": torch.ones(16, dtype=torch.long),
                "labels": self.labels[index]}


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    return {"accuracy": float((np.argmax(prediction.predictions, axis=-1) == prediction.label_ids).mean())}


def bert_classifier(hidden: int = 64) -> torch.nn.Module:
    """A 2-layer BERT sequence classifier (dropout 0, weights from seed 0): its loss is a mean cross-entropy that
    ignores ``num_items_in_batch``, though its forward takes ``**kwargs``."""
    torch.manual_seed(0)
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        hidden_size=hidden, num_hidden_layers=2, num_attention_heads=4, intermediate_size=2 * hidden, vocab_size=64,
        max_position_embeddings=16, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=2))


def loss_factor_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "num_items_in_batch" in r.getMessage()]


def test_a_bert_classifier_trains_and_evaluates_with_compute_metrics(tmp_path, caplog):
    def run(cls, out, **extra):
        args = training_args(str(tmp_path / out), max_steps=40, learning_rate=3e-3, eval_steps=20, logging_steps=10)
        trainer = cls(model=bert_classifier(), args=args, train_dataset=Parity(160, 1), eval_dataset=Parity(48, 2),
                      compute_metrics=accuracy, **extra)
        if cls is transformers.Trainer:
            # Told the model takes no loss kwargs, plain Trainer divides each micro-batch's mean by the accumulation
            # steps: it trains the whole batch's mean, as TorchparTrainer(torchpar_loss="mean") does.
            trainer.model_accepts_loss_kwargs = False
        trainer.train()
        final = trainer.evaluate()
        return trainer, final

    plain, plain_final = run(transformers.Trainer, "plain")
    with caplog.at_level(logging.WARNING, logger="torchpar"):
        ours, our_final = run(TorchparTrainer, "ours", torchpar_method=torchpar.DataParallel(mesh_shape=(1, 4)),
                              torchpar_loss="mean")
    try:
        assert loss_factor_warnings(caplog) == []  # the mean was asked for: nothing to warn about
        assert_logs_match(logged_values(ours.state.log_history), logged_values(plain.state.log_history))
        assert abs(our_final["eval_loss"] - plain_final["eval_loss"]) <= TOLERANCE
        assert our_final["eval_accuracy"] == plain_final["eval_accuracy"]
        assert our_final["eval_accuracy"] > 0.75, our_final  # it learned the rule
        predictions = ours.predict(Parity(8, 3))
        assert predictions.predictions.shape == (8, 2) and "test_accuracy" in predictions.metrics
    finally:
        ours.close()


def test_a_loss_plain_trainer_scales_by_the_accumulation_steps_is_scaled_alike(tmp_path, caplog):
    """BertForSequenceClassification's forward takes ``**kwargs`` but its loss ignores ``num_items_in_batch``: plain
    Trainer (transformers 5.24 ``training_step``) takes the loss as already divided by the update's item count, does
    not divide it by the accumulation steps, and so logs and backpropagates the sum of the micro-batch means (twice
    the batch's mean here). TorchparTrainer logs and trains the same by default, and says why once. SGD, so the
    factor reaches the weights."""
    def run(cls, out, **attributes):
        args = training_args(str(tmp_path / out), max_steps=-1, num_train_epochs=1, eval_strategy="no",
                             logging_steps=1, optim="sgd", learning_rate=0.5, lr_scheduler_type="constant",
                             warmup_steps=0, weight_decay=0.0)
        trainer = cls(model=bert_classifier(hidden=32), args=args, train_dataset=Parity(24, 1))
        for name, value in attributes.items():
            setattr(trainer, name, value)
        trainer.train()
        return trainer

    plain = run(transformers.Trainer, "plain")
    with caplog.at_level(logging.WARNING, logger="torchpar"):
        ours = run(TorchparTrainer, "ours")
    try:
        logged = logged_values(ours.state.log_history)
        assert [step for step, key, _ in logged if key == "loss"] == [1, 2, 3]
        assert_logs_match(logged, logged_values(plain.state.log_history))
        for name, value in plain.model.state_dict().items():
            torch.testing.assert_close(ours.model.state_dict()[name], value, rtol=1e-4, atol=1e-5, msg=name)
        # the first update's loss is the sum of its two micro-batch means: twice the batch's mean, which plain Trainer
        # logs when told the model takes no loss kwargs
        means = run(transformers.Trainer, "mean", model_accepts_loss_kwargs=False).state.log_history
        assert abs(logged[0][2] - 2 * means[0]["loss"]) <= TOLERANCE
        [warning] = loss_factor_warnings(caplog)  # once per trainer
        assert all(words in warning for words in ("does not depend on num_items_in_batch", "model_accepts_loss_kwargs",
                                                   "gradient_accumulation_steps (2)", "torchpar_loss='mean'"))
    finally:
        ours.close()


def test_torchpar_loss_names_its_values(tmp_path):
    train, _ = datasets()
    with pytest.raises(ValueError, match="torchpar_loss must be one of .*'trainer', 'mean'.*'sum'"):
        TorchparTrainer(model=causal_lm("gpt2"), args=training_args(str(tmp_path)), train_dataset=train,
                        torchpar_loss="sum")


@pytest.mark.parametrize("argument, value", [("torch_compile", True), ("gradient_checkpointing", True),
                                             ("neftune_noise_alpha", 5.0), ("auto_find_batch_size", True)])
def test_arguments_torchpar_cannot_honour_are_refused_by_name(argument, value, tmp_path):
    train, _ = datasets()
    with pytest.raises(ValueError, match=argument):
        TorchparTrainer(model=causal_lm("gpt2"), args=training_args(str(tmp_path), **{argument: value}),
                        train_dataset=train)


def test_options_the_training_arguments_set_are_refused_in_torchpar_options(tmp_path):
    train, _ = datasets()
    with pytest.raises(ValueError, match="grad_clip_norm.*max_grad_norm"):
        TorchparTrainer(model=causal_lm("gpt2"), args=training_args(str(tmp_path)), train_dataset=train,
                        torchpar_options={"grad_clip_norm": 1.0})


def test_an_update_the_micro_batches_cannot_split_names_the_remedy(tmp_path):
    train, _ = datasets()
    uneven = torch.utils.data.Subset(train, range(7))  # batches of 4 and 3: an update of 7 rows
    trainer = TorchparTrainer(model=causal_lm("gpt2"), args=training_args(str(tmp_path), eval_strategy="no",
                                                                          max_steps=1), train_dataset=uneven)
    try:
        with pytest.raises(ValueError, match="dataloader_drop_last=True"):
            trainer.train()
    finally:
        trainer.close()


def test_bf16_becomes_the_engines_mixed_precision_not_accelerates_autocast(tmp_path):
    train, _ = datasets()
    args = training_args(str(tmp_path), bf16=True, eval_strategy="no", max_steps=2, use_cpu=True)
    trainer = TorchparTrainer(model=causal_lm("gpt2"), args=args, train_dataset=train)
    try:
        assert trainer.accelerator.mixed_precision == "no"  # the torch forward is not wrapped in autocast
        trainer.train()
        assert trainer.engine.options.mixed_precision == "bf16"
        assert trainer.engine.numerics["mixed_precision"] == "bf16"
        assert np.isfinite(trainer.state.log_history[-1]["train_loss"])
    finally:
        trainer.close()


def test_micro_batches_padded_to_different_lengths_merge_right_padded():
    first = {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3, dtype=torch.long),
             "labels": torch.ones(2, 3, dtype=torch.long)}
    second = {key: torch.ones(1, 5, dtype=torch.long) for key in first}
    merged = merge_micro_batches([first, second], pad_token_id=7)
    assert merged["input_ids"].shape == (3, 5)
    assert merged["input_ids"][0].tolist() == [1, 1, 1, 7, 7]
    assert merged["attention_mask"][0].tolist() == [1, 1, 1, 0, 0]
    assert merged["labels"][0].tolist() == [1, 1, 1, -100, -100]
    with pytest.raises(ValueError, match="'pixel_values'"):
        merge_micro_batches([{"pixel_values": torch.ones(1, 3)}, {"pixel_values": torch.ones(1, 4)}])


def test_the_item_count_spreads_over_rows_and_sums_back_exactly():
    batch = with_item_count({"labels": torch.zeros(8, 4)}, torch.tensor(29))
    assert batch[ITEM_COUNT_KEY].tolist() == [4, 4, 4, 4, 4, 3, 3, 3]
    for parts in (1, 2, 4, 8):
        assert sum(int(chunk.sum()) for chunk in batch[ITEM_COUNT_KEY].chunk(parts)) == 29
    inputs, count = without_item_count(batch)
    assert ITEM_COUNT_KEY not in inputs and int(count) == 29
