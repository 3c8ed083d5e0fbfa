#!/usr/bin/env bash
# The one script to run on a GPU machine: the tests that need TensorRT, CUDA and ONNX Runtime's
# CUDA/TensorRT providers (tests/gpu and the tensorrt cases of the conformance suite), then the
# XLA backend on JAX's CUDA plugin when jax sees a GPU (tests/gpu/test_gpu_xla.py: conformance
# models and the corpus' tv-resnet50 and hf-bert, fp32 and bf16, vs ONNX Runtime CPU).
# Installs nothing and needs no network: it runs what this machine has, says what is missing,
# prints a summary and stops after at most ~9 minutes. Usage: tests/gpu/run.sh [pytest args]
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== GPUs"
nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total --format=csv 2>&1 \
  || echo "nvidia-smi not available"
echo "== packages"
"$PY" - <<'PYEOF'
import importlib, platform
print(f"{'python':12} {platform.python_version()}")
for name in ("enginekit", "tensorrt", "polygraphy", "onnxruntime", "onnx", "torch", "cupy", "pytest"):
    try:
        module = importlib.import_module(name)
        print(f"{name:12} {getattr(module, '__version__', '?')}")
    except Exception as exc:  # report and go on: the tests skip with reasons
        print(f"{name:12} MISSING ({type(exc).__name__}: {exc})")
try:
    import onnxruntime
    print(f"{'ort EPs':12} {onnxruntime.get_available_providers()}")
except Exception:
    pass
try:
    import enginekit as ek
    for a in ek.available_backends():
        state = f"{a.version} on {', '.join(a.devices)}" if a.available else f"unavailable: {a.reason}"
        print(f"{'backend':12} {a.name}: {state}")
except Exception as exc:
    print(f"enginekit does not import: {exc}")
try:  # the GPU image's jax and CUDA plugin differ from our pins: say which are here
    import sys
    sys.path.insert(0, "tests/gpu")
    import xla_gpu
    for key, value in xla_gpu.jax_summary().items():
        print(f"{'jax ' + key:12} {value}")
except Exception as exc:
    print(f"{'jax':12} MISSING ({type(exc).__name__}: {exc})")
PYEOF
if ! "$PY" -c "import pytest" 2>/dev/null; then
  echo "pytest is not installed here; nothing to run"; exit 2
fi
echo "== tests: TensorRT, ONNX Runtime CUDA/TensorRT providers"
start=$(date +%s)
timeout --signal=INT 300 "$PY" -m pytest tests/gpu tests/conformance -k "(gpu or tensorrt) and not xla" \
  -q -rs -p no:cacheprovider --durations=10 "$@"
rc=$?
echo "== tests: XLA backend on JAX's CUDA plugin"
timeout --signal=INT 240 "$PY" -m pytest tests/gpu/test_gpu_xla.py -q -rs -s -p no:cacheprovider \
  --durations=5 "$@"
rc_xla=$?
echo "== done in $(( $(date +%s) - start )) s, pytest exit codes $rc (TensorRT/ORT), $rc_xla (XLA)" \
  "(124/130: stopped at the time limit; 5: nothing ran)"
[ $rc -ne 0 ] && [ $rc -ne 5 ] && exit $rc
[ $rc_xla -ne 0 ] && [ $rc_xla -ne 5 ] && exit $rc_xla
exit 0
