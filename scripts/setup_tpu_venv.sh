#!/usr/bin/env bash
# Create (once) a venv with jax[tpu] at the project's jax version and the project's
# dependencies, for deviceless TPU compiles (tests/test_tpu_compile.py): libtpu is the real
# TPU compiler; it runs without a TPU. Every call installs this checkout into it (editable,
# without dependencies) unless it is there already, so `import jaxmamba.kernels` in that venv
# imports this tree's kernels.
#
#   scripts/setup_tpu_venv.sh [PYTHON]   -> prints the venv's python path on the last line
#
# The venv lives in ${JAXMAMBA_TPU_VENV:-${XDG_CACHE_HOME:-~/.cache}/jaxmamba/tpu-venv-<jax>},
# so CI can cache that folder; a second call only checks it.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${1:-python3}
JAX_VERSION=$("$PY" -c 'import jax; print(jax.__version__)')
VENV=${JAXMAMBA_TPU_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/jaxmamba/tpu-venv-$JAX_VERSION}
PIP_INSTALL=(-m pip install -q --disable-pip-version-check)
if [[ ! -x "$VENV/bin/python" ]] || ! "$VENV/bin/python" -c 'import libtpu, jax, flax' 2>/dev/null; then
  rm -rf "$VENV.tmp"
  "$PY" -m venv "$VENV.tmp"
  "$VENV.tmp/bin/python" "${PIP_INSTALL[@]}" "jax[tpu]==$JAX_VERSION" -e "$ROOT" >&2
  rm -rf "$VENV"
  mv "$VENV.tmp" "$VENV"
  # venvs hard-code their path in scripts, not in bin/python: the move is safe for `python -m`.
fi
INSTALLED=$(cd / && "$VENV/bin/python" -c 'import jaxmamba.kernels as k; print(k.__file__)' 2>/dev/null || true)
if [[ "$INSTALLED" != "$ROOT/kernels/__init__.py" ]]; then
  (cd / && "$VENV/bin/python" "${PIP_INSTALL[@]}" --no-deps -e "$ROOT" >&2)
fi
echo "$VENV/bin/python"
