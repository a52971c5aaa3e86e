"""A pipeline by hand: cut an MLP with mark_pipeline_boundary and place the stages with ManualStageOption.

    python examples/mlp_manual_stages.py [--runtime local|ray] [--micro-batches 4] [--schedule 1f1b]

Two simulated hosts of 4 devices; stage 0 (layers 0–1) on host 0 as a 1×4 mesh, stage 1 (layers 2–3)
on host 1 as a 2×2 mesh. Prints the plan, the schedule's instruction lists and the loss per step next to
PyTorch's.
"""

from __future__ import annotations

import argparse
import copy

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runtime", choices=("local", "ray"), default="local")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=("1f1b", "gpipe"), default="1f1b")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    torchpar.init(cluster=args.runtime, num_hosts=2, devices_per_host=4)

    import torch

    from torchpar.planner.pipeline.schedules import format_schedule, make_schedule

    class MLP(torch.nn.Module):
        def __init__(self, width: int = 128, depth: int = 4):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

        def forward(self, x, y):
            for index, layer in enumerate(self.layers):
                x = torch.relu(layer(x))
                if index < len(self.layers) - 1:
                    x = torchpar.mark_pipeline_boundary(x)  # a layer ends here
            return torch.nn.functional.mse_loss(x, y)

    torch.manual_seed(0)
    model = MLP()
    reference = copy.deepcopy(model)
    batch = (torch.randn(64, 128), torch.randn(64, 128))
    stages = torchpar.ManualStageOption(forward_stage_layer_ids=((0, 1), (2, 3)),
                                       submesh_physical_shapes=((1, 4), (1, 4)),
                                       submesh_logical_shapes=((1, 4), (2, 2)))
    method = torchpar.PipeshardParallel(num_micro_batches=args.micro_batches, layer_option="manual",
                                        stage_option=stages, schedule=args.schedule)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with torchpar.compile(model, optimizer, example_batch=batch, method=method) as engine:
        print(engine.plan.summary())
        print(format_schedule(make_schedule(args.schedule, 2, args.micro_batches)))
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
        print(f"{'step':>4}  {'torchpar':>10}  {'PyTorch':>10}")
        for step in range(args.steps):
            ref_opt.zero_grad()
            loss = reference(*batch)
            loss.backward()
            ref_opt.step()
            print(f"{step:>4}  {engine.step(batch):>10.6f}  {loss.item():>10.6f}")


if __name__ == "__main__":
    main()
