#!/usr/bin/env bash
# `make gpu-check`: the whole test suite on a GPU, then the GPU benchmarks.
#
# For a bare GPU machine with no network whose python already has jax (CUDA),
# flax, optax, chex, torch, orbax-checkpoint and pytest (the device image):
# what it lacks (jmp, pyclipper, shapely, ...) is installed from wheels brought
# along in .whl/ (`make gpu-wheels` fetches them on a machine with a network;
# .whl/ is git-ignored). It uses that machine's own python, not a venv.
# Results: benchmarks/results/bench_gpu_gpu.{md,json} and
# benchmarks/results/tests_gpu.md (device, driver, versions, test summary).
# Without a GPU it says so and exits 2 without running anything.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${GPU_PYTHON:-python3}
RESULTS=benchmarks/results

if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "make gpu-check: no NVIDIA GPU here (nvidia-smi finds none); nothing was run." >&2
  exit 2
fi
if ! "$PY" -c 'import jax, sys; sys.exit(jax.default_backend() != "gpu")' 2>/dev/null; then
  echo "make gpu-check: $PY's jax sees no GPU; nothing was run." >&2
  exit 2
fi

SITE=/tmp/jaxstable-gpu-site
if compgen -G ".whl/*.whl" >/dev/null; then
  # --no-deps: the image already has the heavy dependencies; install only
  # what is missing, never replacing the machine's jax or torch.
  missing=()
  for whl in .whl/*.whl; do
    name=$(basename "$whl" | cut -d- -f1 | tr '_' '-')
    "$PY" -m pip show -q "$name" >/dev/null 2>&1 || missing+=("$whl")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$SITE" "${missing[@]}" || exit 1
  fi
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
for mod in jax flax optax chex jmp torch pytest; do
  "$PY" -c "import $mod" 2>/dev/null || {
    echo "make gpu-check: python module '$mod' is missing; bring its wheel in .whl/ (make gpu-wheels)" >&2
    exit 1
  }
done

mkdir -p "$RESULTS"
# GPU_CHECK_PARTS=tests or =bench runs one half (a lease's one command has a
# time limit); the default runs both.
PARTS=${GPU_CHECK_PARTS:-all}
tests_rc=0
bench_rc=0
if [ "$PARTS" != bench ]; then
# pytest-xdist, where the machine has it, spreads the suite over its cores
# (XLA_PYTHON_CLIENT_PREALLOCATE=false, set by conftest.py, lets the workers
# share the GPU's memory); --dist loadfile keeps a file on one worker, so its
# module-scoped runs are built once (as in `make test`).
xdist=()
"$PY" -c "import xdist" 2>/dev/null && xdist=(-n "${GPU_CHECK_WORKERS:-8}" --dist loadfile)
export XLA_PYTHON_CLIENT_PREALLOCATE=false
log=$(mktemp)
"$PY" -m pytest -q -p no:cacheprovider "${xdist[@]}" 2>&1 | tee "$log"
tests_rc=${PIPESTATUS[0]}
{
  echo "# Test suite on a GPU (\`make gpu-check\`)"
  echo
  echo "Device: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
  "$PY" -c 'import jax, torch; print(f"jax {jax.__version__} {jax.devices()}; torch {torch.__version__} (CUDA {torch.version.cuda})")'
  echo
  echo '```'
  grep -iE "passed|failed|error" "$log" | tail -n 40
  echo '```'
} >"$RESULTS/tests_gpu.md"
fi
if [ "$PARTS" != tests ]; then
  # GPU_LIMIT_<PART>=seconds stops one benchmark at a time limit (a lease's
  # command has one); bench_models.py writes its results after every row,
  # so a stopped run keeps what it measured. 0: no limit.
  bench() {
    local limit=$1
    shift
    if [ "$limit" -gt 0 ]; then timeout "$limit" "$PY" "$@"; else "$PY" "$@"; fi
    local rc=$?
    echo "make gpu-check: $* exited $rc"
    [ "$rc" -eq 0 ] || bench_rc=1
  }
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # jax and torch share the GPU
  # The guard's cost at the real models' sizes, torch (bf16 autocast) and JAX.
  bench "${GPU_LIMIT_MODELS:-0}" benchmarks/bench_models.py --device cuda \
    --shapes real --cpus 0 --compile-workers 8
  # Cross-entropy (the Pallas kernel) against the copy-bandwidth floor, and
  # the guarded segmentation step; GPU_BENCH_GPU_ONLY=ce runs the first.
  bench "${GPU_LIMIT_CE:-0}" benchmarks/bench_gpu.py --device cuda \
    --only "${GPU_BENCH_GPU_ONLY:-all}"
  # linear_cross_entropy at 32k and 128k vocabularies against the naive path.
  bench "${GPU_LIMIT_LINEAR_CE:-0}" benchmarks/bench_linear_ce.py --device cuda \
    --tokens 8192 --features 1024
fi
echo "make gpu-check: tests exit $tests_rc, benchmarks exit $bench_rc; results in $RESULTS/"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
