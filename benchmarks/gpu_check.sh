#!/usr/bin/env bash
# GPU readiness check of issue 27: the per-step overhead of capture on CUDA for torch and
# JAX, with the steps in flight (how far a step dispatches ahead of the device without
# waiting, with and without capture), printed as one table by step_overhead.py.
#
# Usage (from the repository root, or any folder holding traintape/ and benchmarks/):
#   bash benchmarks/gpu_check.sh            # CUDA if a GPU is visible, else a CPU smoke run
#   bash benchmarks/gpu_check.sh --smoke    # the CPU smoke run (what the test runs, < 60 s)
# Environment: PYTHON (default: python3), GPU_CHECK_ROUNDS (default 6),
#   GPU_CHECK_MODELS (default tiny,deep,small,medium,large), GPU_CHECK_FRAMEWORKS (torch,jax).
# Exit status: that of step_overhead.py (non-zero when a framework fails on the device).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(dirname "$here")"
py="${PYTHON:-python3}"
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# torch and JAX share the GPU in one process: JAX must not take 75% of it up front
export XLA_PYTHON_CLIENT_PREALLOCATE=false

mode=cuda
if [[ "${1:-}" == "--smoke" ]]; then
    mode=smoke
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check: no GPU visible (nvidia-smi): CPU smoke run instead"
    mode=smoke
elif ! "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: nvidia-smi sees a GPU but torch does not: CPU smoke run instead"
    mode=smoke
fi

if [[ "$mode" == smoke ]]; then
    echo "gpu_check: SMOKE mode on the CPU (nothing here is a GPU measurement)"
    exec "$py" "$here/step_overhead.py" --quick --models tiny --rounds 2 --ahead 5 \
        --frameworks "${GPU_CHECK_FRAMEWORKS:-torch,jax}" --device cpu
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
"$py" - <<'EOF' || echo "gpu_check: the environment report failed (see above); measuring anyway"
import jax, torch
from traintape.core import native
print(f"torch {torch.__version__} cuda {torch.version.cuda} on {torch.cuda.get_device_name(0)};"
      f" jax {jax.__version__} backend {jax.default_backend()} devices {jax.devices()}")
try:
    lib = native.fused_lib()
    print(f"traintape C kernel: {'loaded, ' + native.origin() if lib else 'NOT available'}"
          f" (compiler: {native.compiler()})")
except Exception as e:  # the kernel's availability is information, not a failure here
    print(f"traintape C kernel: could not be checked ({type(e).__name__}: {e})")
EOF
exec "$py" "$here/step_overhead.py" --device cuda \
    --frameworks "${GPU_CHECK_FRAMEWORKS:-torch,jax}" \
    --models "${GPU_CHECK_MODELS:-tiny,deep,small,medium,large}" \
    --rounds "${GPU_CHECK_ROUNDS:-6}" --ahead 50
