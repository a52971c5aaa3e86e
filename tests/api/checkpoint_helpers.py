"""The run the checkpoint tests interrupt and resume: a tiny GPT-2 (no dropout) with AdamW and a StepLR schedule,
trained on four batches in turn. Imported by the tests and by the processes they start and kill."""

from __future__ import annotations

from typing import Any

import torch
import transformers

import torchpar

STEPS = 10
SAVE_AT = 5


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """The model, its optimizer and LR scheduler, in their initial state (the same in every process)."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.1)
    return model, optimizer, torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)


def batch(step: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (8, 16), generator=torch.Generator().manual_seed(step % 4))
    return {"input_ids": ids, "labels": ids}


def method(name: str) -> Any:
    """The methods the tests move a checkpoint between, on the session's 8 devices."""
    if name == "zero3":
        return torchpar.Zero3Parallel(mesh_shape=(1, 4))
    if name == "data_parallel":  # every device of the cluster
        return torchpar.DataParallel()
    if name == "pipeline":  # 2 stages of 4 devices each (the submeshes tile the 8 devices)
        stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0,), (1,)),
                                            submesh_physical_shapes=((1, 4), (1, 4)),
                                            submesh_logical_shapes=((1, 4), (1, 4)))
        return torchpar.PipeshardParallel(num_micro_batches=2, layer_option=torchpar.AutoLayerOption(layer_num=2),
                                          stage_option=stages)
    assert name == "one_device", name
    return None


def compile(name: str) -> tuple[Any, torch.optim.Optimizer, Any]:
    model, optimizer, scheduler = build()
    return torchpar.compile(model, optimizer, example_batch=batch(0), method=method(name)), optimizer, scheduler


def train(engine: Any, scheduler: Any, steps: range) -> list[float]:
    losses = []
    for step in steps:
        losses.append(engine.step(batch(step)).item())
        scheduler.step()
    return losses
