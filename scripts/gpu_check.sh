#!/usr/bin/env bash
# On a GPU machine with no network: install the project offline, build the C++
# extension, run the CUDA tests and the CUDA benchmarks, and write a summary.
#
#   scripts/gpu_check.sh [--wheels DIR] [--out DIR] [--jobs N]
#
# DIR of wheels supplies what the machine lacks (e.g. platformdirs, cryptography
# and cffi, which signed cache bundles need).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS="" OUT_DIR="gpu-check" JOBS=8 PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
    case "$1" in
        --wheels) WHEELS="$2"; shift 2 ;;
        --out) OUT_DIR="$2"; shift 2 ;;
        --jobs) JOBS="$2"; shift 2 ;;
        *) echo "unknown argument $1" >&2; exit 2 ;;
    esac
done
mkdir -p "$OUT_DIR"
if [ -n "$WHEELS" ]; then
    "$PY" -m pip install -q --no-index --find-links "$WHEELS" "$WHEELS"/*.whl
fi
"$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .
export AOTI_EAGER_CACHE_DIR="$(mktemp -d)/aoti_eager"
"$PY" -c "import aoti_eager._extension as e; e.load(); print('extension built')"

{
    echo "# aoti_eager GPU check"
    "$PY" -c "import torch, triton; print(f'torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} x{torch.cuda.device_count()}')"
} > "$OUT_DIR/summary.md"

# pytest-xdist, where present, spreads the compiles over the machine's cores.
PARALLEL=()
"$PY" -c "import xdist" 2>/dev/null && PARALLEL=(-n "$JOBS")
set +e
"$PY" -m pytest -q -p no:cacheprovider "${PARALLEL[@]}" -k cuda tests 2>&1 | tee "$OUT_DIR/tests.log"
TESTS=${PIPESTATUS[0]}
set -e
{
    echo; echo "## CUDA tests (pytest -k cuda)"; tail -n 1 "$OUT_DIR/tests.log"
    echo; echo "## Dispatch latency (scripts/bench_dispatch.py --device cuda)"; echo '```'
    "$PY" scripts/bench_dispatch.py --device cuda --calls 20000
    echo '```'
    echo; echo "## Composite ops (scripts/bench_composite.py --device cuda)"; echo '```'
    "$PY" scripts/bench_composite.py --device cuda
    echo '```'
} 2>&1 | tee -a "$OUT_DIR/summary.md"
exit "$TESTS"
