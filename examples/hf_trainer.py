"""Fine-tune a tiny HuggingFace GPT-2 with ``transformers.Trainer``'s loop, the step run by torchpar.

    python examples/hf_trainer.py [--steps 40] [--devices 4] [--method data_parallel|one_device|pipeline]

The only change from a plain Trainer script is the class (``TorchparTrainer``) and ``torchpar_method``: the
Trainer keeps its data loading, cosine schedule with warmup, gradient accumulation (the engine's micro-batches),
clipping, logging, evaluation and checkpoints (``output_dir/checkpoint-N``, with the engine's sharded state in
``checkpoint-N/torchpar``; ``trainer.train(resume_from_checkpoint=True)`` resumes). ``save_model`` writes a
directory plain transformers loads.
"""

from __future__ import annotations

import argparse
import tempfile

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--method", choices=["data_parallel", "one_device", "pipeline"], default="data_parallel")
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=args.devices)  # before anything imports JAX

    import torch
    import transformers

    from torchpar.integrations.transformers import TorchparTrainer

    transformers.logging.set_verbosity_error()

    class Tokens(torch.utils.data.Dataset):
        """Random token rows; the model learns their unigram statistics (a stand-in for a tokenized corpus)."""

        def __init__(self, n: int, seed: int):
            generator = torch.Generator().manual_seed(seed)
            self.ids = torch.randint(0, 64, (n, 32), generator=generator) % (1 + torch.arange(32) % 16)

        def __len__(self) -> int:
            return len(self.ids)

        def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
            return {"input_ids": self.ids[index], "labels": self.ids[index]}

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=64, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=0, eos_token_id=0))
    method = {"one_device": None, "data_parallel": torchpar.DataParallel(),
              "pipeline": torchpar.PipeshardParallel(layer_option=torchpar.AutoLayerOption(layer_num=2))}[args.method]
    with tempfile.TemporaryDirectory() as output_dir:
        training_args = transformers.TrainingArguments(
            output_dir, max_steps=args.steps, per_device_train_batch_size=8, per_device_eval_batch_size=8,
            gradient_accumulation_steps=2, learning_rate=3e-3, lr_scheduler_type="cosine", warmup_steps=4,
            weight_decay=0.01, max_grad_norm=1.0, logging_steps=max(1, args.steps // 4), eval_strategy="steps",
            eval_steps=max(1, args.steps // 2), save_strategy="no", report_to=[], disable_tqdm=True, seed=0)
        trainer = TorchparTrainer(model=model, args=training_args, train_dataset=Tokens(512, 1),
                                  eval_dataset=Tokens(64, 2), torchpar_method=method)
        trainer.train()
        for entry in trainer.state.log_history:
            if "loss" in entry:
                print(f"step {entry['step']:3d}  loss {entry['loss']:.4f}  grad norm {entry['grad_norm']:.3f}  "
                      f"lr {entry['learning_rate']:.2e}  {entry['torchpar_tokens_per_s']:.0f} tokens/s")
            elif "eval_loss" in entry:
                print(f"step {entry['step']:3d}  eval loss {entry['eval_loss']:.4f}")
        print(trainer.engine.plan.summary().splitlines()[0])
        trainer.save_model(f"{output_dir}/final")  # a save_pretrained directory
        reloaded = transformers.AutoModelForCausalLM.from_pretrained(f"{output_dir}/final")
        print(f"saved and reloaded with plain transformers: {sum(p.numel() for p in reloaded.parameters())} "
              "parameters")
        trainer.close()


if __name__ == "__main__":
    main()
