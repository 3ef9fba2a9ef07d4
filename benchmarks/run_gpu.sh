#!/usr/bin/env bash
# One device call: install carried wheels (if any), then run the given GPU scripts in
# order, each writing its JSON under $OUT, all output teed to $OUT/log.txt.
#   bash benchmarks/run_gpu.sh "pytest -m gpu tests" benchmarks/kernels/bench_sampling.py ...
# Arguments after a script name are passed to it when quoted together: "script.py --small".
# A leading "SECONDS:" caps one job ("120:benchmarks/x.py --quick"), so one slow job cannot eat
# the whole device call; "pytest ..." jobs run `python3 -m pytest ...`.
# The device receives this working tree but its .git can be the last landed snapshot, so
# pass the local commit: RLFUSE_COMMIT=$(git rev-parse --short HEAD) (benchmarks print it).
set -uo pipefail
cd "$(dirname "$0")/.."
export OUT="${OUT:-./out}" PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$OUT"
export RLFUSE_COMMIT="${RLFUSE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown) (device .git; may be stale)}"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit $RLFUSE_COMMIT"
} 2>&1 | tee -a "$OUT/log.txt"
status=0
for job in "$@"; do
  echo "=== $job" | tee -a "$OUT/log.txt"
  start=$(date +%s)
  limit=0
  if [[ "$job" =~ ^([0-9]+):(.*)$ ]]; then limit=${BASH_REMATCH[1]}; job=${BASH_REMATCH[2]}; fi
  [[ "$job" == pytest* ]] && job="-m $job"
  # shellcheck disable=SC2086
  timeout -k 5 "$limit" python3 $job 2>&1 | tee -a "$OUT/log.txt"
  rc=${PIPESTATUS[0]}
  echo "=== $job: exit $rc in $(( $(date +%s) - start )) s" | tee -a "$OUT/log.txt"
  [ "$rc" -ne 0 ] && status=1
done
exit $status
