#!/usr/bin/env bash
# The GPU checks of issues 15 and 17 as prepared steps for a lent GPU machine (no network there; see
# ../.library/device/README.md in the workplace, or any CUDA machine with Python 3.12 and a CUDA torch + Triton).
#
#   scripts/gpu_check.sh prepare   # HERE (network): wheels the GPU image lacks -> .gpu/whl, Brown -> .gpu/nltk_data
#   scripts/gpu_check.sh tests     # THERE: install into /tmp/site, then the CUDA / Triton tests       (~2-3 min)
#   scripts/gpu_check.sh bench     # THERE: bench_step on CUDA, V = 1e5, 1e6, 1e7, b = 1024 and 8192  (~6-8 min)
#   scripts/gpu_check.sh train     # THERE: the default job (DP-sparse CBOW on Brown) on CUDA, capped at 4 min
#
# Each THERE step writes its log and JSON under $OUT (default .gpu/out) and carries on past a failing part. Carry
# `.gpu` with the working tree. The GPU image has its own torch (not widedp's pin); torchrec needs an fbgemm-gpu built
# for that torch (too large to carry), so the recommender and torchrec tests are not run there.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-.gpu/out}
PY=${PY:-python3}

install() {
  mkdir -p "$OUT"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 NLTK_DATA=$PWD/.gpu/nltk_data HF_DATASETS_OFFLINE=1
  export WIDEDP_NATIVE_DIR=/tmp/widedp-native
  "$PY" -m pip install -q --no-deps --no-build-isolation --target /tmp/site . || exit 1
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton",
triton.__version__, torch.cuda.get_device_name(0))' | tee "$OUT/versions.txt"
  "$PY" -m widedp.native || true  # the C++ kernels (CPU side of the same tests)
}

case "${1:-}" in
prepare)
  mkdir -p .gpu/whl
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  for spec in nltk==3.10.4 dp-accounting==0.6.0 dm-tree==0.1.9 opacus==1.6.0; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .gpu/whl "$spec" || exit 1
  done
  rm -rf .gpu/nltk_data && cp -r ../shared/nltk_data .gpu/nltk_data
  du -sh .gpu
  ;;
tests)
  install
  "$PY" -m pytest -q -p no:cacheprovider -o addopts="" tests/native/test_gpu.py tests/native/test_native.py \
    tests/dp/test_step_cuda.py tests/dp/test_optim.py tests/dp/test_syncs.py tests/models/test_cbow.py \
    "tests/api/test_api_engine.py::test_short_dp_run_on_cuda_learns_and_states_the_cpu_epsilon" -k "not recsys" \
    2>&1 | tee "$OUT/tests.log"
  ;;
bench)
  install
  for b in 1024 8192; do
    timeout 280 "$PY" bench/bench_step.py --part vocab --device cuda --vocab 1e5 1e6 1e7 --batch "$b" \
      --vocab-steps 20 2>&1 | tee "$OUT/bench_b$b.log"
    cp bench/out/bench_step_cuda_b"$b".json "$OUT/" 2>/dev/null || true
  done
  ;;
train)
  install
  timeout 240 "$PY" -m widedp train configs/brown_cbow_sparse_exp.yaml --set train.device=cuda --out /tmp/run-cuda \
    --no-progress 2>&1 | tee "$OUT/train.log"
  cp /tmp/run-cuda/summary.json "$OUT/train_summary.json" 2>/dev/null || true
  ;;
*)
  sed -n '2,13p' "$0"
  exit 2
  ;;
esac
