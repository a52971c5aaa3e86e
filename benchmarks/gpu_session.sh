#!/usr/bin/env bash
# One lent GPU, one call of at most 10 minutes: the headline first, then the Pallas kernels' rows (issue 50).
#
#   run(command="bash benchmarks/gpu_session.sh", timeout_s=600)      # the device tool; JSON lands under $OUT
#
# The device has torch, JAX with CUDA and transformers but no Ray and no OR-Tools: nothing here needs them (one device,
# no ILP). Each part has its own timeout so a hang in one leaves time for the next, and each script writes its JSON
# after every row. Copy the JSON into benchmarks/results/ with the device's name and record the figures in
# benchmarks/README.md and the stop's note.
set -u
out=${OUT:-benchmarks/results}
mkdir -p "$out"
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_PREALLOCATE=false
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, jax, transformers; print('torch', torch.__version__, 'jax', jax.__version__, 'transformers', transformers.__version__)"
  git rev-parse HEAD 2>/dev/null || true
} > "$out/gpu_session_device.txt" 2>&1
cat "$out/gpu_session_device.txt"

echo "--- 1. headline: GPT-2 124M, bf16 then tf32, eager / torch.compile / torchpar (gpu_single.py)"
timeout 300 python benchmarks/gpu_single.py --models gpt2 --modes bf16,tf32 --steps 10 --warmup 3 \
  --out "$out/gpu_single_gpt2.json" || echo "gpu_single: exit $?"

echo "--- 2. grouped GEMM: Pallas kernel vs gathered vs ragged_dot vs torch._grouped_mm, bf16 (grouped_matmul.py)"
timeout 110 python benchmarks/grouped_matmul.py --experts 8,32,64 --dtypes bf16 \
  --json "$out/grouped_matmul_gpu.json" || echo "grouped_matmul: exit $?"

echo "--- 3. attention blocks: Pallas flash block and XLA blocks vs cuDNN, 8K-32K tokens (attention_gpu.py)"
timeout 150 python benchmarks/attention_gpu.py --lengths 8192,16384,32768 --steps 5 \
  --json "$out/attention_gpu.json" || echo "attention_gpu: exit $?"
ls -l "$out"
