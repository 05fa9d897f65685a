#!/usr/bin/env bash
# The test extra the GPU machine lacks (transformers >= 5.25, llguidance, the server's fastapi,
# uvicorn, openai, schemathesis), as wheels for its Python 3.12, into .gpu_wheels/ (git-ignored)
# to carry to it; there `pip install --no-index --find-links .gpu_wheels ...` installs what is
# missing (the machine reaches no index). numpy is left out: the machine's own stays.
# Run from the checkout root: bash scripts/dev/gpu_test_wheels.sh   (about 48 MB)
set -eu
rm -rf .gpu_wheels
PLATFORMS=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64)
python3 -m pip download -q -d .gpu_wheels --python-version 3.12 --only-binary=:all: \
  "${PLATFORMS[@]}" "transformers>=5.25" "llguidance>=1.9" "fastapi>=0.115" "uvicorn>=0.30" \
  "openai>=1.40" "schemathesis>=4.0" "prometheus-client>=0.20" "httpx>=0.27"
rm -f .gpu_wheels/numpy-*
grep -qx '/.gpu_wheels/' .gitignore || echo '/.gpu_wheels/' >> .gitignore
du -sh .gpu_wheels
