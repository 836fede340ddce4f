#!/usr/bin/env bash
# The GPU checks as prepared steps for a lent GPU machine (no network there; see
# ../.library/device/README.md in the workplace, or any CUDA machine with Python 3.12 and a CUDA torch + Triton).
#
#   scripts/gpu_check.sh prepare   # HERE (network): wheels the GPU image lacks -> .gpu/whl, Brown -> .gpu/nltk_data
#   scripts/gpu_check.sh tests     # THERE: install into /tmp/site, then the CUDA / Triton tests (H200: ~1 min)
#   scripts/gpu_check.sh bench     # THERE: bench_step on CUDA, V = 1e5, 1e6, 1e7, b = 1024 and 8192 (H200: ~5.5 min)
#   scripts/gpu_check.sh train     # THERE: the default job (DP-sparse CBOW on Brown) on CUDA (H200: 24 s)
#   scripts/gpu_check.sh all       # THERE: the three in one go, each capped (75 s + 75 s + 2 x 200 s; H200: ~7 min)
#   scripts/gpu_check.sh wide      # THERE: bench_step at V = 1e7 and 1e8, D = 64, b = 1024: the DP-sparse step, the
#                                  #   non-private sparse step, dense DP-SGD (or its out-of-memory); peak GPU memory
#   scripts/gpu_check.sh job       # THERE: bench/job_speed.py: the pair-level job and the default job, samples/s on
#                                  #   the GPU against one CPU thread of the same machine
#   scripts/gpu_check.sh lease     # THERE: job, then wide, each capped (2 x 120 s + 240 s): one call under 10 min
#
# Run `prepare` again after every change: it builds the widedp wheel that THERE installs.
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
  # widedp travels as a wheel built here by `prepare`: the image's setuptools may be older than the >=77 that
  # pyproject.toml's license field needs, and nothing can be fetched there.
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl \
    || exit 1
  # PYTHONSAFEPATH: `python -m` would otherwise put the checkout first on sys.path, and its widedp/ lacks the
  # widedp.models / data_prep / eval subpackages that the installed wheel maps in (package-dir).
  export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 NLTK_DATA=$PWD/.gpu/nltk_data HF_DATASETS_OFFLINE=1
  export WIDEDP_NATIVE_DIR=/tmp/widedp-native
  "$PY" -c 'import torch, triton, widedp; print("torch", torch.__version__, "cuda", torch.version.cuda, "triton",
triton.__version__, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA", "widedp from", widedp.__file__)' | tee "$OUT/versions.txt"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee -a "$OUT/versions.txt"
  "$PY" -m widedp.native || true  # the C++ kernels (CPU side of the same tests)
}

run_tests() {  # $1: seconds
  timeout "${1:-600}" "$PY" -m pytest -q -p no:cacheprovider -o addopts="" --tb=short -rfE \
    tests/native/test_gpu.py tests/native/test_native.py \
    tests/dp/test_step_cuda.py tests/dp/test_optim.py tests/dp/test_syncs.py tests/models/test_cbow.py \
    "tests/api/test_api_engine.py::test_short_dp_run_on_cuda_learns_and_states_the_cpu_epsilon" -k "not recsys" \
    2>&1 | tee "$OUT/tests.log"
}

run_bench() {  # $1: seconds per batch size
  for b in 1024 8192; do
    timeout "${1:-280}" "$PY" bench/bench_step.py --part vocab --device cuda --vocab 1e5 1e6 1e7 --batch "$b" \
      --vocab-steps 20 2>&1 | tee "$OUT/bench_b$b.log"
    cp bench/out/bench_step_cuda_b"$b".json "$OUT/" 2>/dev/null || true
  done
}

run_wide() {  # $1: seconds
  timeout "${1:-300}" "$PY" bench/bench_step.py --part vocab --device cuda --vocab 1e7 1e8 --dim 64 --batch 1024 \
    --vocab-steps 20 --methods nonprivate_sparse_adam dp_sparse_lazy_adam dpsgd_dense_lazy_adam \
    --out "$OUT/bench_step_wide.json" 2>&1 | tee "$OUT/wide.log"
}

run_job() {  # $1: seconds per config (CPU and GPU together)
  for cfg in configs/brown_cbow_sparse_exp.yaml configs/brown_cbow_sentence_wordfreq.yaml; do
    name=$(basename "$cfg" .yaml)
    timeout "${1:-240}" "$PY" bench/job_speed.py "$cfg" --devices cpu cuda --steps 600 --log-every 100 \
      --timeout "$(( ${1:-240} / 2 ))" --out "$OUT/job_$name.json" 2>&1 | tee "$OUT/job_$name.log"
  done
}

run_train() {  # $1: seconds
  timeout "${1:-240}" "$PY" -m widedp train configs/brown_cbow_sparse_exp.yaml --set train.device=cuda \
    --out /tmp/run-cuda --no-progress 2>&1 | tee "$OUT/train.log"
  cp /tmp/run-cuda/summary.json "$OUT/train_summary.json" 2>/dev/null || true
}

case "${1:-}" in
prepare)
  # here, the project's venv (make setup) when there is one: building widedp's wheel needs setuptools >= 77
  [ -x .venv/bin/python ] && PY=.venv/bin/python
  mkdir -p .gpu/whl
  grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude
  # wordfreq (and what it imports): the default job's public vocabulary (data.vocabulary: wordfreq)
  for spec in nltk==3.10.4 dp-accounting==0.6.0 dm-tree==0.1.9 opacus==1.6.0 wordfreq==3.1.1 ftfy==6.3.1 \
      wcwidth==0.9.4 langcodes==3.5.1 locate==1.1.1 msgpack==1.2.4 regex==2026.11.19; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform any -d .gpu/whl "$spec" || exit 1
  done
  # wordfreq's wheel is 55 MB, most of it other languages' lists; only English travels (the 64 MiB carry limit)
  "$PY" - .gpu/whl/wordfreq-3.1.1-py3-none-any.whl <<'PYEOF' || exit 1
import re, sys, zipfile
path = sys.argv[1]
src = zipfile.ZipFile(path)
drop = {i.filename for i in src.infolist() if re.fullmatch(r"wordfreq/data/\w+_(?!en\.)\w+\.msgpack\.gz", i.filename)}
items = {i.filename: src.read(i) for i in src.infolist() if i.filename not in drop}
src.close()
record = next(n for n in items if n.endswith(".dist-info/RECORD"))
items[record] = "".join(line + "\n" for line in items[record].decode().splitlines()
                        if line.split(",")[0] not in drop).encode()
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as out:
    for name, data in items.items():
        out.writestr(name, data)
PYEOF
  rm -rf .gpu/nltk_data && cp -r ../shared/nltk_data .gpu/nltk_data
  rm -rf build .gpu/whl/widedp-*.whl && "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .gpu/whl . || exit 1
  du -sh .gpu
  ;;
tests)
  install
  run_tests
  ;;
bench)
  install
  run_bench
  ;;
train)
  install
  run_train
  ;;
all)  # one lease: tests, the default job, then the benchmark (the timed part last, alone on the GPU)
  install
  run_tests 75
  run_train 75
  run_bench 200
  ;;
wide)
  install
  run_wide
  ;;
job)
  install
  run_job
  ;;
lease)  # the step at V = 1e8 and the whole jobs' speed: one call of at most ~9 min (install included)
  install
  run_job 120
  run_wide 240
  ;;
*)
  sed -n '2,22p' "$0"
  exit 2
  ;;
esac
