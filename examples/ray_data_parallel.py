"""Data parallelism over the hosts of a Ray cluster: every host actor owns its devices, the gradient
all-reduce crosses hosts.

    python examples/ray_data_parallel.py [--hosts 2] [--devices-per-host 2] [--steps 5]
    python examples/ray_data_parallel.py --address auto        # join a running cluster (`ray start ...`)

Without ``--address`` it simulates ``--hosts`` hosts on this machine (an embedded Ray, one actor process per
host, each with ``--devices-per-host`` JAX CPU devices, or GPUs where the machine has enough). With an
address every alive node is a host, owning its GPUs. Each host actor then says where it ran.
"""

from __future__ import annotations

import argparse

import torchpar


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", default=None, help="a Ray cluster to join ('auto' or 'ip:port')")
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--devices-per-host", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if args.address:
        cluster = torchpar.init(cluster="ray", address=args.address)
    else:
        cluster = torchpar.init(cluster="ray", num_hosts=args.hosts, devices_per_host=args.devices_per_host)
    print(f"cluster: {cluster.num_hosts} host(s) × {cluster.devices_per_host} {cluster.accelerator} device(s)")

    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, config.vocab_size, (4 * cluster.num_devices, 16))
    batch = {"input_ids": ids, "labels": ids}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    try:
        with torchpar.compile(model, optimizer, example_batch=batch, method=torchpar.DataParallel()) as engine:
            for step in range(args.steps):
                print(f"step {step}  loss {engine.step(batch):.4f}")
            for worker in engine.describe_workers():
                print(f"host actor {worker['rank']}: pid {worker['pid']}, JAX process {worker['process_index']} of "
                      f"{worker['process_count']}, devices {worker['local_devices']}, {worker['steps_run']} steps")
            engine.sync_to_torch()  # the trained weights are back in `model`
    finally:
        torchpar.shutdown()


if __name__ == "__main__":
    main()
