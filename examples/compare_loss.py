"""Train a model with PyTorch and with torchpar side by side and compare the loss curves.

    python examples/compare_loss.py --model gpt2 --steps 20 --optimizer adamw --plot loss.png

Prints a per-step table, writes a PNG of both curves, and exits with status 1 if the relative loss
difference ever exceeds --tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys

from torchpar import zoo
from torchpar.report.compare import OPTIMIZERS, compare_training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=zoo.FAMILIES, default="gpt2", help="model family (tiny config)")
    parser.add_argument("--config", default="{}", help='JSON config overrides, e.g. \'{"n_layer": 4}\'')
    parser.add_argument("--steps", type=int, default=20, help="training steps")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default 1e-3, SGD 0.02)")
    parser.add_argument("--method", choices=("none",), default="none", help="parallel method (none = one device)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tolerance", type=float, default=1e-4, help="max relative loss difference")
    parser.add_argument("--plot", default="compare_loss.png", help="PNG path ('' to skip)")
    args = parser.parse_args(argv)

    result = compare_training(args.model, steps=args.steps, optimizer=args.optimizer, lr=args.lr,
                              overrides=json.loads(args.config), batch_size=args.batch_size,
                              seq_len=args.seq_len, seed=args.seed, tolerance=args.tolerance)
    print(f"{args.model} with {args.optimizer}, {args.steps} steps, torchpar on {result.method}")
    print(result.table())
    if args.plot:
        result.plot(args.plot)
        print(f"plot written to {args.plot}")
    return 0 if result.passed else 1


if __name__ == "__main__":
    sys.exit(main())
