#!/usr/bin/env bash
# Measure 13 plans of a 1.1B Llama (TinyLlama dims) and 4 of an 8-layer Llama 3 8B stage on ONE GPU with
# the jax runner, as proxies of 8-GPU plans (one pipeline stage's layers, one DP rank's micro-batches),
# print predicted vs measured step time and memory, then calibrate the cost model on half of the runs and
# score the other half. The 17 records of 2026-12-04 (H200) are tests/data/gpu/h200_verify_runs.json, those of
# 2026-12-06 (GPU=h100) h100_verify_runs.json.
#   tests/gpu/verify_gpu.sh [OUT_DIR]        (GPU=h200 by default; PYTHON=python)
# Without a GPU visible to JAX it says so and exits 0. Needs jax with CUDA (pip install 'jax[cuda12]').
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python}
GPU=${GPU:-h200}
OUT=${1:-results/verify_gpu}
backend=$($PY -c "import jax; print(jax.default_backend())" 2>/dev/null || echo "none")
if [ "$backend" != "gpu" ]; then
  echo "verify_gpu: no GPU visible to JAX (backend: $backend); nothing measured."
  exit 0
fi
mkdir -p "$OUT"
MODEL=tests/data/llama_1b_config.json
PLANS=(
  "tp=1,pp=1,mbs=1"
  "tp=1,pp=1,mbs=2"
  "tp=1,pp=1,mbs=2,recompute=selective"
  "tp=1,pp=1,mbs=4,recompute=full"
  "tp=1,pp=2,mbs=1"
  "tp=1,pp=2,mbs=2,recompute=selective"
  "tp=1,pp=2,mbs=4,recompute=full"
  "tp=1,pp=1,mbs=8,recompute=full"
  "tp=1,pp=1,mbs=4"
  "tp=1,pp=1,mbs=2,recompute=full"
  "tp=1,pp=1,mbs=8"
  "tp=1,pp=1,mbs=4,recompute=selective"
  "tp=1,pp=1,mbs=1,recompute=full"
)
PLANS_8B=(
  "tp=1,pp=4,mbs=1"
  "tp=1,pp=4,mbs=2"
  "tp=1,pp=4,mbs=2,recompute=full"
  "tp=1,pp=4,mbs=1,recompute=selective"
)
for plan in "${PLANS[@]}"; do
  echo "== $plan"
  $PY -m cli.main verify --model "$MODEL" --gpu "$GPU" --gpus 8 --global-batch 64 --seq-len 2048 \
      --plan "$plan" --proxy --steps 5 --out "$OUT/runs" || echo "   (exit $? recorded)"
done
for plan in "${PLANS_8B[@]}"; do
  echo "== llama3-8b $plan"
  $PY -m cli.main verify --model llama3-8b --gpu "$GPU" --gpus 8 --global-batch 16 --seq-len 4096 \
      --plan "$plan" --proxy --steps 4 --out "$OUT/runs" || echo "   (exit $? recorded)"
done
$PY - "$OUT" "$GPU" <<'PYEOF'
import glob, json, os, subprocess, sys
out, gpu = sys.argv[1], sys.argv[2]
recs = [r for f in sorted(glob.glob(os.path.join(out, "runs", "*.json"))) for r in json.load(open(f))]
ok = [r for r in recs if r["usable"]]
print(f"\n{len(ok)} usable measurements of {len(recs)}")
print("memory: predicted without the fixed 3 GB (CUDA context, NCCL) vs the allocator's peak_bytes_in_use")
print(f"{'run':58s} {'pred s':>8s} {'meas s':>8s} {'err %':>7s} {'pred GB':>8s} {'meas GB':>8s}")
for r in recs:
    p, m = r["run"]["predicted"], r["measured"]
    err = 100 * (p["step_time_s"] / m["iteration_time_s"] - 1) if m["iteration_time_s"] else float("nan")
    print(f"{r['id'][:58]:58s} {p['step_time_s']:8.3f} {m['iteration_time_s'] or 0:8.3f} {err:+7.1f} "
          f"{p['memory_gb_without_fixed']:8.2f} {m['memory_gb'] or 0:8.2f}")
train, test = ok[0::2], ok[1::2]
for name, rows in (("train", train), ("test", test)):
    json.dump(rows, open(os.path.join(out, f"{name}.json"), "w"), indent=1)
cal = os.path.join(out, "calibration.json")
subprocess.run([sys.executable, "-m", "cli.main", "calibrate", os.path.join(out, "train.json"), "--gpu", gpu,
                "-o", cal, "--holdout-frac", "0", "--json"], check=True, stdout=subprocess.DEVNULL)
def mape(extra):
    res = subprocess.run([sys.executable, "-m", "cli.main", "validate", os.path.join(out, "test.json"), "--json", *extra],
                         check=True, capture_output=True, text=True)
    return json.loads(res.stdout)["mape_pct"]
print(f"held-out half ({len(test)} runs): MAPE {mape([]):.1f} % with the shipped constants, "
      f"{mape(['--calibration', cal]):.1f} % calibrated on the other {len(train)}")
PYEOF
