"""Train a model with PyTorch and with torchpar side by side and compare the loss curves.

    python examples/compare_loss.py --model gpt2 --steps 20 --optimizer adamw --plot loss.png
    python examples/compare_loss.py --model llama --method shard --devices 8

Prints a per-step table (both losses and their relative difference), writes a PNG of both curves, and
exits with status 1 if the relative loss difference ever exceeds --tolerance. This is
``python -m torchpar compare``; ``--help`` lists every option (family, config, steps, optimizer, lr,
method, devices, batch size, sequence length, seed, tolerance).
"""

from __future__ import annotations

import sys

from torchpar.__main__ import main

if __name__ == "__main__":
    sys.exit(main(["compare", *sys.argv[1:]]))
