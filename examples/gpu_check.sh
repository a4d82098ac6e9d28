#!/usr/bin/env bash
# Device check of the CUDA backend: build, GPU tests, H2D benchmark, decode benchmark.
#
#   examples/gpu_check.sh OUTDIR
#
# Needs: a CUDA GPU, JAX with CUDA, nanobind, scikit-build-core, cmake, ninja and pytest
# already installed (no network is used). Runs in about 6 minutes at most: every step has
# its own cap and the whole script a deadline. Writes into OUTDIR:
#   build.log, pytest.log, pytest.xml     the install and tests/runtime/cuda
#   transfer.json                         engine start/wait H2D GB/s vs plain cudaMemcpyAsync
#   decode.json, decode.log               python -m jax_tpusync.bench decode (if present)
#   summary.json                          exit status and seconds of every step
# Exit status: 0 when the build and the tests passed (benchmarks are informational).
set -u -o pipefail

if [[ $# -ne 1 ]]; then
  echo "usage: $0 OUTDIR" >&2
  exit 2
fi
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python}
DEADLINE=$((SECONDS + ${GPU_CHECK_BUDGET_S:-350}))
declare -A RC DUR

# run NAME CAP_S CMD...: runs CMD under min(CAP_S, time left), recording rc and seconds.
run() {
  local name=$1 cap=$2
  shift 2
  local left=$((DEADLINE - SECONDS))
  ((left < cap)) && cap=$left
  if ((cap < 5)); then
    echo "== $name: skipped, out of time"
    RC[$name]=skipped
    DUR[$name]=0
    return 0
  fi
  echo "== $name (cap ${cap}s)"
  local t0=$SECONDS
  timeout --kill-after=5 "$cap" "$@"
  RC[$name]=$?
  DUR[$name]=$((SECONDS - t0))
  echo "== $name: rc=${RC[$name]} in ${DUR[$name]}s"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1

# 1. Build and install (no build isolation: the build requirements are installed already).
run build 200 "$PY" -m pip install --no-build-isolation --no-deps -v "$REPO" \
  > "$OUT/build.log" 2>&1
grep -h "jax_tpusync: CUDA support" "$OUT/build.log" | tail -1

# Outside the source tree, so `import jax_tpusync` finds the installed package and its
# extension modules rather than the sources.
cd "$OUT"

# 2. The CUDA tests (they skip, with a reason, if JAX sees no CUDA GPU).
run pytest 120 "$PY" -m pytest "$REPO/tests/runtime/cuda" -q -rs -p no:cacheprovider \
  --junitxml="$OUT/pytest.xml" > "$OUT/pytest.log" 2>&1
tail -5 "$OUT/pytest.log"

# 3. Engine start/wait H2D vs plain cudaMemcpyAsync from pinned memory, same sizes.
run transfer 60 "$PY" - "$OUT/transfer.json" > "$OUT/transfer.log" 2>&1 <<'PYEOF'
import json, os, shutil, sys, tempfile
import numpy as np
from jax_tpusync.runtime import _cuda
from jax_tpusync.runtime.engine import Engine

ext = _cuda.extension()
assert ext is not None, "built without CUDA support"
assert _cuda.register(), "no CUDA GPU visible to JAX"
MiB = 1 << 20
sizes = [1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
out = {"sizes": sizes, "cuda_runtime": ext.cuda_runtime_version(),
       "memcpy_pinned_gbps": ext.memcpy_h2d_gbps(sizes, iters=10)}
with Engine(num_workers=2) as e:
  t = e.add_host_tier(block_bytes=MiB, num_blocks=max(sizes) // MiB)
  e.write(t, 0, np.full(max(sizes), 1, np.uint8))  # Fault the pool in.
  out["engine_host_gbps"] = ext.engine_h2d_gbps(e.id, t, 0, sizes, iters=10)
  out["engine_stats_host"] = e.stats()
d = tempfile.mkdtemp(prefix="tpusync-gpu-check-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
try:
  with Engine(num_workers=2) as e:
    file_sizes = sizes[:4]
    t = e.add_file_tier(d, block_bytes=MiB, num_blocks=max(file_sizes) // MiB)
    e.write(t, 0, np.full(max(file_sizes), 1, np.uint8))
    out["file_sizes"] = file_sizes
    out["file_direct_io"] = e.tier_info(t).direct_io
    out["engine_file_gbps"] = ext.engine_h2d_gbps(e.id, t, 0, file_sizes, iters=5)
finally:
  shutil.rmtree(d, ignore_errors=True)
out["cuda_stats"] = ext.stats()
out["async_error"] = ext.async_error()
json.dump(out, open(sys.argv[1], "w"), indent=2)
for i, s in enumerate(sizes):
  print(f"{s // MiB:4d} MiB  memcpy {out['memcpy_pinned_gbps'][i]:6.2f} GB/s  "
        f"engine(host) {out['engine_host_gbps'][i]:6.2f} GB/s")
PYEOF
cat "$OUT/transfer.log" | tail -8

# 4. The decode benchmark, if this tree has it. Registration is done here so the check
#    does not depend on ops._register() already knowing about CUDA. That starts JAX, so the
#    bench may not split CPUs any more (--engine-cpus 0; compute runs on the GPU anyway).
if "$PY" -c "import jax_tpusync.bench.decode" > /dev/null 2>&1; then
  # Same as `python -m jax_tpusync.bench decode ...`, also before "decode" is listed in
  # the CLI's SUBCOMMANDS.
  run decode 90 "$PY" -c '
import sys
from jax_tpusync.runtime import _cuda
_cuda.register()
from jax_tpusync.bench import __main__ as cli
subs = tuple(cli.SUBCOMMANDS) + (() if "decode" in cli.SUBCOMMANDS else ("decode",))
args = cli.build_parser(subs).parse_args(sys.argv[1:])
results = args.run(args)
cli.print_results(results, getattr(args, "columns", None))
cli.common.write_json(args.json, args.subcommand, args, results)
' decode --tier host --context 8192 --steps 5 --warmup 1 --engine-cpus 0 \
    --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
  tail -5 "$OUT/decode.log"
else
  echo "== decode: jax_tpusync.bench.decode not in this tree, skipped"
  RC[decode]=absent
  DUR[decode]=0
fi

{
  echo "{"
  first=1
  for name in build pytest transfer decode; do
    ((first)) || echo ","
    first=0
    printf '  "%s": {"rc": "%s", "seconds": %s}' "$name" "${RC[$name]:-not_run}" "${DUR[$name]:-0}"
  done
  printf ',\n  "total_seconds": %s\n}\n' "$SECONDS"
} > "$OUT/summary.json"
cat "$OUT/summary.json"

[[ "${RC[build]:-1}" == 0 && "${RC[pytest]:-1}" == 0 ]]
