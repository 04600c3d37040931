# Sourced by the run_*.sh scripts: creates the project's virtual environment
# (default .venv, or $AOTI_EAGER_VENV) and installs the package into it.
# torch==2.13.0 (or $AOTI_EAGER_TORCH) is installed first where the venv has
# no torch, or $AOTI_EAGER_TORCH names another, so that the package's torch
# range never pulls a multi-GB CUDA build by itself.
VENV="${AOTI_EAGER_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV"
fi
WANTED_TORCH="${AOTI_EAGER_TORCH:-}"
HAVE_TORCH="$("$VENV/bin/python" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null || true)"
if [ -z "$HAVE_TORCH" ] || { [ -n "$WANTED_TORCH" ] && [ "$HAVE_TORCH" != "$WANTED_TORCH" ]; }; then
    "$VENV/bin/pip" install -q "torch==${WANTED_TORCH:-2.13.0}"
fi
# bench: transformers, whose models (built from configs) the region tests fuse.
"$VENV/bin/pip" install -q -e ".[test,remote,bench]"
# The fleet cache's tests run a real redis-server (tests/test_remote.py); they
# skip, saying why, where it is missing and cannot be installed (not root).
if ! command -v redis-server >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -q redis-server >/dev/null || (apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null) \
        || echo "setup_env: redis-server could not be installed; the fleet cache's tests will skip" >&2
fi
PYTHON="$VENV/bin/python"
