"""A ``TorchparTrainer`` run in its own process (``tests/integrations/test_hf_trainer.py``): ``killed`` trains the
acceptance's 30 steps, saving every 10, and kills its process (``os._exit``) right after the checkpoint at step 20;
``resume`` trains to step 30 from that checkpoint. Both log every step; the history is written to
``<output_dir>/history.json`` and the final model with ``save_model`` to ``<output_dir>/final``."""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torchpar  # noqa: E402

torchpar.init(cluster="local", num_devices=1)

import transformers  # noqa: E402
from hf_trainer_cases import causal_lm, datasets, training_args  # noqa: E402

from torchpar.integrations.transformers import TorchparTrainer  # noqa: E402

KILL_AT = 20


class KillAfterSave(transformers.TrainerCallback):
    """Ends the process the way a crash would (no cleanup, no ``finally``) once step ``KILL_AT`` is saved."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == KILL_AT:
            os._exit(0)


def run_args(output_dir: str) -> transformers.TrainingArguments:
    return training_args(output_dir, logging_steps=1, save_strategy="steps", save_steps=10, save_total_limit=2)


def main(mode: str, output_dir: str) -> None:
    train, evaluation = datasets()
    trainer = TorchparTrainer(model=causal_lm("gpt2"), args=run_args(output_dir), train_dataset=train,
                              eval_dataset=evaluation, callbacks=[KillAfterSave()] if mode == "killed" else None)
    trainer.train(resume_from_checkpoint=os.path.join(output_dir, f"checkpoint-{KILL_AT}") if mode == "resume" else None)
    Path(output_dir, "history.json").write_text(json.dumps(trainer.state.log_history))
    trainer.save_model(os.path.join(output_dir, "final"))
    trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
