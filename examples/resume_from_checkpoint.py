"""Train, save a sharded checkpoint, and resume it in a new engine with another plan.

    python examples/resume_from_checkpoint.py [--steps 3] [--dir /tmp/ckpt] [--resume-method one_device|zero3|pipeline]

A GPT-2 trains for ``--steps`` steps under ZeRO-3 on 4 devices (parameters and optimizer state sharded 4 ways)
and is saved with its LR scheduler: each device's shards go into a safetensors file of their own, beside an
``index.json``. A second engine — a fresh model, optimizer and scheduler, another method — loads it, each of its
devices reading only the slices it holds, and trains on; the first engine trains on too, and the two print the
same losses (to float rounding: the plans sum in different orders). In a real job the second engine lives in a
new process, after a crash or a preemption.
"""

from __future__ import annotations

import argparse
import tempfile

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to save (default: a temporary directory)")
    parser.add_argument("--resume-method", choices=("one_device", "zero3", "pipeline"), default="one_device")
    args = parser.parse_args()
    torchpar.init(cluster="local", num_devices=8)

    import torch
    import transformers

    from torchpar.checkpoint import read_index

    transformers.logging.set_verbosity_error()

    def build():
        torch.manual_seed(0)
        # no dropout: its masks are drawn per device, so another plan draws others (the same plan resumes the
        # checkpoint's PRNG stream bit for bit, dropout included)
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        model = transformers.GPT2LMHeadModel(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    def batch(step: int) -> dict:
        ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(step))
        return {"input_ids": ids, "labels": ids}

    methods = {
        "one_device": None,
        "zero3": torchpar.Zero3Parallel(mesh_shape=(1, 4)),
        "pipeline": torchpar.PipeshardParallel(
            num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=2),
            stage_option=torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                                    submesh_physical_shapes=((1, 4), (1, 4)),
                                                    submesh_logical_shapes=((1, 4), (1, 4)))),
    }
    scratch = tempfile.TemporaryDirectory(prefix="torchpar-")  # removed at exit
    path = f"{args.dir or scratch.name}/checkpoint"

    model, optimizer, scheduler = build()
    first = torchpar.compile(model, optimizer, example_batch=batch(0), method=methods["zero3"])
    for step in range(args.steps):
        print(f"step {step}  loss {first.step(batch(step)):.6f}  (zero3)")
        scheduler.step()
    first.save(path, scheduler=scheduler)
    index = read_index(path)
    print(f"saved {path}: {len(index['files'])} shard files, {len(index['tensors'])} tensors, "
          f"step {index['steps_taken']}, lr {optimizer.param_groups[0]['lr']:g}")

    model2, optimizer2, scheduler2 = build()  # fresh: as a new process would build them
    with torchpar.compile(model2, optimizer2, example_batch=batch(0), method=methods[args.resume_method]) as second:
        second.load(path, scheduler=scheduler2)
        print(f"loaded into {args.resume_method}: step {scheduler2.last_epoch}, lr {optimizer2.param_groups[0]['lr']:g}")
        for step in range(args.steps, 2 * args.steps):
            resumed, uninterrupted = second.step(batch(step)), first.step(batch(step))
            scheduler2.step()
            scheduler.step()
            print(f"step {step}  loss {resumed:.6f}  (resumed, {args.resume_method})  {uninterrupted:.6f}  (zero3, "
                  "never stopped)")
    first.close()


if __name__ == "__main__":
    main()
