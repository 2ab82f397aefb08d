#!/usr/bin/env bash
# The benchmark suite at accelerator sizes, for a machine with a GPU (or TPU) that already
# has JAX with its accelerator plugin installed; installs nothing. Run from the repository
# root:
#
#     bash benchmarks/accelerator.sh               # accelerator sizes, about 9 minutes
#     bash benchmarks/accelerator.sh --real-sizes  # real model sizes, under 8 minutes
#     bash benchmarks/accelerator.sh --tiny        # tiny sizes (CPU check of this script)
#
# --real-sizes: the full GRPO train step of Qwen2.5-0.5B, Qwen2.5-1.5B and Llama-3-8B shapes
# (configs/real_sizes.py: 64 Sokoban episodes, context 1047, bf16 parameters and
# activations, float32 master weights and moments, remat) compiled for the device, its
# planned memory against the analytic estimate, and two real steps of each shape that
# fits the device (benchmarks/real_sizes.py --accelerator).
#
# Results (RESULTS.md, PNGs, accelerator.log) go to $OUT when set, else benchmarks/.
# Every benchmark runs under its own `timeout`, so the whole suite stays within 13 minutes (the sum of its limits)
# even when one of them hangs; a failure is logged and the suite goes on.
set -u

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ -z "${OUT:-}" ]; then
  export OUT="$PWD/benchmarks"
fi
mkdir -p "$OUT"
LOG="$OUT/accelerator.log"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# Do not grab 75% of the accelerator's memory up front: the scripts report XLA's planned
# memory per program, and several programs live in one process.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

TINY=0
REAL_SIZES=0
if [ "${1:-}" = "--tiny" ]; then
  TINY=1
elif [ "${1:-}" = "--real-sizes" ]; then
  REAL_SIZES=1
fi

SUITE_START=$(date +%s)
FAILED=()

run() {  # run NAME SECONDS COMMAND...
  local name="$1" seconds="$2"
  shift 2
  local start
  start=$(date +%s)
  echo "== $name (limit ${seconds}s): $*" | tee -a "$LOG"
  timeout --kill-after=10 "$seconds" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  echo "== $name: exit $rc after $(( $(date +%s) - start ))s" | tee -a "$LOG"
  if [ "$rc" -ne 0 ]; then
    FAILED+=("$name (exit $rc)")
  fi
}

{
  echo "# accelerator suite $(date -u '+%Y-%m-%d %H:%M UTC'), tiny=$TINY real_sizes=$REAL_SIZES"
  "$PYTHON" -c 'import jax; print("jax", jax.__version__, jax.devices())'
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv
} 2>&1 | tee -a "$LOG"

if [ "$TINY" = 1 ]; then
  run ppo_cartpole 900 "$PYTHON" benchmarks/ppo_cartpole.py --sizes 4:16 --repeats 1 \
    --curve-updates 2 --seeds 1
  run agentic_step 900 "$PYTHON" benchmarks/agentic_step.py --algorithms grpo \
    --num-tasks 2 --group-size 2 --d-model 32 --layers 1 --repeats 1 --peak-size 256
  run scaling 900 "$PYTHON" benchmarks/scaling.py --base 2,2,2,0 --batches 4 --extras 0 \
    --turns 2 --groups 2 --d-model 32 --layers 1 --repeats 1
  run sharding_overhead 900 env JAX_PLATFORMS=cpu "$PYTHON" benchmarks/sharding_overhead.py \
    --devices 2 --num-tasks 2 --group-size 2 --d-model 32 --layers 1 --repeats 1
  run real_sizes 900 "$PYTHON" benchmarks/real_sizes.py --accelerator --tiny --steps 1 \
    --num-tasks 2 --group-size 2
  run async_rollouts 900 "$PYTHON" benchmarks/async_rollouts.py --tiny --steps 2 --rounds 1
  run continuous_batching 900 "$PYTHON" benchmarks/continuous_batching.py --tiny --steps 1 \
    --rounds 1 --workloads long_tail
  run continuous_batching_rollout 900 "$PYTHON" benchmarks/continuous_batching.py \
    --rollout-only --tiny --rounds 1 --workloads long_tail
elif [ "$REAL_SIZES" = 1 ]; then
  # One process: compile 0.5B, 1.5B, 8B for the device (~1-2 min each), run 2 steps of
  # those that fit. The 8B step state alone (8.03e9 x 14 bytes = 112 GB) exceeds one chip.
  run real_sizes 450 "$PYTHON" benchmarks/real_sizes.py --accelerator --steps 2
else
  # PureJaxRL's 4 / 64 envs with 128 steps and 2048 envs with 128 steps; the 4-env
  # learning curve for 400 updates (204,800 env steps) x 2 seeds.
  run ppo_cartpole 160 "$PYTHON" benchmarks/ppo_cartpole.py \
    --sizes 4:128,64:128,2048:128 --repeats 5 --curve-updates 400 --seeds 2
  # A transformer big enough to occupy the chip: d_model 512, 4 layers, 512 rows.
  run agentic_step 90 "$PYTHON" benchmarks/agentic_step.py --num-tasks 64 --group-size 8 \
    --d-model 512 --layers 4 --heads 8 --repeats 5 --peak-size 8192
  # Six compiled points (base B 256, S 51): B 1024, S +64 per reply, 2 / 16 turns, G 32.
  run scaling 170 "$PYTHON" benchmarks/scaling.py --base 32,8,4,0 \
    --batches 256,1024 --extras 0,64 --turns 2,4,16 --groups 8,32 \
    --d-model 256 --layers 2 --repeats 5
  # Rollout/update overlap (asynchronous rollouts, lag 0/1/2 vs the fused step and the
  # bound max(rollout, update)) with a host tool; colocated on one accelerator.
  run async_rollouts 150 "$PYTHON" benchmarks/async_rollouts.py --steps 4 --rounds 3
  # Slot scheduling and partial rollouts against lockstep on the device: the long-tailed
  # workload and guess_number, 8 and 32 of 32 rows, partial rollouts at staleness 1 and 2.
  run continuous_batching 150 "$PYTHON" benchmarks/continuous_batching.py --steps 2 \
    --rounds 3 --slots 0.25,1.0 --workloads long_tail,guess_number
  # Where the rollout's time goes on the device: iterations and ms per iteration.
  run continuous_batching_rollout 100 "$PYTHON" benchmarks/continuous_batching.py \
    --rollout-only --rounds 3 --slots 0.25,1.0 --workloads long_tail,guess_number
  # One accelerator: the 1 vs 8 device comparison runs on fake CPU devices of the host.
  run sharding_overhead 50 env JAX_PLATFORMS=cpu "$PYTHON" benchmarks/sharding_overhead.py \
    --devices 8 --num-tasks 8 --group-size 4 --repeats 3
fi

echo "== suite finished in $(( $(date +%s) - SUITE_START ))s; results in $OUT" | tee -a "$LOG"
if [ "${#FAILED[@]}" -ne 0 ]; then
  echo "== failed: ${FAILED[*]}" | tee -a "$LOG"
  exit 1
fi
