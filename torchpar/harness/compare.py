"""Train one model with PyTorch and with torchpar from the same initial weights and compare losses.

``compare_training`` is what ``examples/compare_loss.py`` runs: both runs see the same batches and
the same optimizer hyper-parameters; the result holds the per-step losses and their relative
difference ``|torchpar − torch| / |torch|``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from torchpar.harness import zoo

if TYPE_CHECKING:
    from torchpar.methods import Method

log = logging.getLogger(__name__)

OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclasses.dataclass
class Comparison:
    """Per-step losses of both runs and whether they agree within ``tolerance`` (relative)."""

    family: str
    optimizer: str
    method: str
    torch_losses: list[float]
    torchpar_losses: list[float]
    tolerance: float

    @property
    def relative_diffs(self) -> list[float]:
        return [abs(b - a) / max(abs(a), 1e-12) for a, b in zip(self.torch_losses, self.torchpar_losses)]

    @property
    def max_relative_diff(self) -> float:
        return max(self.relative_diffs, default=0.0)

    @property
    def passed(self) -> bool:
        return self.max_relative_diff <= self.tolerance

    HEADER = f"{'step':>4}  {'torch loss':>12}  {'torchpar loss':>13}  {'rel. diff':>9}"

    @staticmethod
    def row(step: int, torch_loss: float, torchpar_loss: float) -> str:
        """One line of :meth:`table` (what ``compare_training``'s ``on_step`` callers print as the run goes)."""
        diff = abs(torchpar_loss - torch_loss) / max(abs(torch_loss), 1e-12)
        return f"{step:>4}  {torch_loss:>12.6f}  {torchpar_loss:>13.6f}  {diff:>9.2e}"

    def verdict(self) -> str:
        verdict = "OK" if self.passed else "DIVERGED"
        return f"max rel. diff {self.max_relative_diff:.2e} (tolerance {self.tolerance:.0e}): {verdict}"

    def table(self) -> str:
        rows = [self.row(step, a, b) for step, (a, b) in enumerate(zip(self.torch_losses, self.torchpar_losses))]
        return "\n".join([self.HEADER, *rows, self.verdict()])

    def plot(self, path: str) -> None:
        """Write a PNG with both loss curves and the relative difference."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True, height_ratios=(3, 1))
        steps = range(len(self.torch_losses))
        top.plot(steps, self.torch_losses, "o-", label="PyTorch eager")
        top.plot(steps, self.torchpar_losses, "x--", label=f"torchpar ({self.method})")
        top.set_ylabel("loss")
        top.set_title(f"{self.family}, {self.optimizer}")
        top.legend()
        bottom.semilogy(steps, [max(d, 1e-12) for d in self.relative_diffs], ".-", color="tab:red")
        bottom.axhline(self.tolerance, color="gray", linestyle=":", label="tolerance")
        bottom.set_xlabel("step")
        bottom.set_ylabel("rel. diff")
        bottom.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)


def make_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """The optimizer both runs use: AdamW/Adam with weight decay, or SGD with Nesterov momentum."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=0.0)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-4)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")


def compare_training(
    family: str,
    *,
    steps: int = 20,
    optimizer: str = "adamw",
    lr: float | None = None,
    method: Method | None = None,
    overrides: dict[str, Any] | None = None,
    batch_size: int = 4,
    seq_len: int = 32,
    seed: int = 0,
    tolerance: float = 1e-4,
    progress: bool = True,
    on_step: Callable[[int, float, float], None] | None = None,
) -> Comparison:
    """Run ``steps`` training steps of ``family`` in PyTorch and in torchpar and collect both loss curves.
    ``on_step(step, torch_loss, torchpar_loss)`` is called after each step (the CLI prints the table's rows as they
    come); ``progress``: a tqdm bar over the steps."""
    from tqdm.auto import tqdm

    import torchpar

    torch.manual_seed(seed)
    model, batch = zoo.build(family, overrides, batch_size=batch_size, seq_len=seq_len)
    reference = copy.deepcopy(model)
    lr = lr if lr is not None else (1e-3 if optimizer != "sgd" else 0.02)
    torch_opt = make_optimizer(optimizer, reference.parameters(), lr)
    engine = torchpar.compile(
        model, make_optimizer(optimizer, model.parameters(), lr), example_batch=batch, method=method
    )
    reference.train()
    torch_losses, torchpar_losses = [], []
    for _ in tqdm(range(steps), desc=f"{family}/{optimizer}", disable=not progress, leave=False):
        torch_opt.zero_grad()
        loss = _loss_of(reference, batch)
        loss.backward()
        torch_opt.step()
        torch_losses.append(float(loss.detach()))
        torchpar_losses.append(engine.step(batch).item())
        if on_step is not None:
            on_step(len(torch_losses) - 1, torch_losses[-1], torchpar_losses[-1])
    method_name = type(method).__name__ if method is not None else "one device"
    return Comparison(family, optimizer, method_name, torch_losses, torchpar_losses, tolerance)


def _loss_of(model: torch.nn.Module, batch: object) -> torch.Tensor:
    from torchpar.capture.export import batch_to_call_args, select_loss

    args, kwargs = batch_to_call_args(batch)
    return select_loss(model(*args, **kwargs), batch, None)
