#!/usr/bin/env bash
# Create (once) a venv with jax[tpu] at the project's jax version, for deviceless TPU compiles
# (tests/test_tpu_compile.py). libtpu is the real TPU compiler; it runs without a TPU.
#
#   scripts/setup_tpu_venv.sh [PYTHON]   -> prints the venv's python path on the last line
#
# The venv lives in ${JAXMAMBA_TPU_VENV:-${XDG_CACHE_HOME:-~/.cache}/jaxmamba/tpu-venv-<jax>},
# so CI can cache that folder; a second call is a no-op.
set -euo pipefail
PY=${1:-python3}
JAX_VERSION=$("$PY" -c 'import jax; print(jax.__version__)')
VENV=${JAXMAMBA_TPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxmamba/tpu-venv-$JAX_VERSION}
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import libtpu, jax' 2>/dev/null; then
  rm -rf "$VENV.tmp"
  "$PY" -m venv "$VENV.tmp"
  "$VENV.tmp/bin/python" -m pip install -q --disable-pip-version-check "jax[tpu]==$JAX_VERSION" >&2
  rm -rf "$VENV"
  mv "$VENV.tmp" "$VENV"
  # venvs hard-code their path in scripts, not in bin/python: the move is safe for `python -m`.
fi
echo "$VENV/bin/python"
