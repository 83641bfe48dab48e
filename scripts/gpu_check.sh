#!/usr/bin/env bash
# scripts/gpu_check.sh: the whole system on a CUDA machine (docs/operations.md "A check on GPUs").
#
# Builds what it needs from the package registries (a virtualenv with torch 2.14.1's CUDA wheels
# and SGLang 0.5.23: `pip install -e '.[gpu]'`), makes SmolLM2-135M-Instruct
# (`centerline make-model smollm2`), then runs `centerline up` with SGLang on the GPU and the
# trainer on the GPU (one rank; two where there are two GPUs, one each): a few in-flight steps
# (--max-inflight-steps 2) at K = 128, where one dataset row is a two-turn session; finally
# teacher-forces every sampled token of the run on a fresh SGLang server on the GPU
# (`centerline teacher-force`). Prints one PASS or FAIL line per check and exits 1 on the first
# FAIL.
#
#   scripts/gpu_check.sh                    # work in runs/gpu-check
#   GPU_CHECK_DIR=/tmp/gc GPU_CHECK_STEPS=4 scripts/gpu_check.sh
#   GPU_CHECK_VENV=.venv scripts/gpu_check.sh   # an environment that has them already
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
WORK=${GPU_CHECK_DIR:-$ROOT/runs/gpu-check}
STEPS=${GPU_CHECK_STEPS:-3}
VENV=${GPU_CHECK_VENV:-$ROOT/.venv-gpu}
K=128
mkdir -p "$WORK"

pass() { echo "PASS: $*"; }
fail() {
    echo "FAIL: $*"
    exit 1
}

# 1. The GPUs
command -v nvidia-smi >/dev/null || fail "nvidia-smi not found: this check needs a CUDA machine"
GPUS=$(nvidia-smi -L | grep -c '^GPU ' || true)
[ "$GPUS" -ge 1 ] || fail "nvidia-smi lists no GPU"
RANKS=1
[ "$GPUS" -ge 2 ] && RANKS=2
pass "$GPUS GPU(s): the trainer runs $RANKS rank(s)"

# 2. What it needs, from the registries
if [ ! -x "$VENV/bin/python" ]; then
    python3 -m venv "$VENV" || fail "python3 -m venv $VENV"
fi
PY=$VENV/bin/python
if ! "$PY" -c "import sglang, torch, centerline" 2>/dev/null; then
    "$PY" -m pip install -q --upgrade pip >"$WORK/pip.log" 2>&1 || fail "pip upgrade; see $WORK/pip.log"
    "$PY" -m pip install -q -e ".[gpu]" >>"$WORK/pip.log" 2>&1 || fail "pip install -e '.[gpu]'; see $WORK/pip.log"
fi
SEEN=$("$PY" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
[ "$SEEN" -ge "$RANKS" ] || fail "torch $("$PY" -c 'import torch; print(torch.__version__)') sees $SEEN CUDA device(s)"
pass "torch $("$PY" -c 'import torch; print(torch.__version__)') sees $SEEN CUDA device(s); sglang $("$PY" -c 'import sglang; print(sglang.__version__)')"

# 3. The model
MODEL=$WORK/smollm2
"$PY" -m centerline make-model smollm2 --out "$MODEL" >"$WORK/make-model.log" 2>&1 ||
    fail "centerline make-model smollm2; see $WORK/make-model.log"
pass "SmolLM2-135M-Instruct in $MODEL"

# 4. A run: SGLang and the trainer on the GPU, K = 128, sessions, steps in flight
DATASET=$WORK/capitals.jsonl
ENVIRONMENT=tests.real_model.environments:capital_twice # a two-turn session per sample
cat >"$DATASET" <<EOF
{"prompt": "What is the capital of Germany?", "answer": "Berlin"}
{"prompt": "What is the capital of Italy?", "answer": "Rome", "environment": "$ENVIRONMENT"}
{"prompt": "What is the capital of Spain?", "answer": "Madrid", "environment": "$ENVIRONMENT"}
{"prompt": "What is the capital of France?", "answer": "Paris", "split": "eval"}
EOF
RUN=$WORK/run
rm -rf "$RUN"
# The engine takes a third of GPU 0's memory: the trainer's rank 0 shares that GPU.
if ! "$PY" -m centerline up --model "$MODEL" --dataset "$DATASET" --reward tests.real_model.rewards:contains_answer \
    --steps "$STEPS" --run-dir "$RUN" --workers 1 --engines 1 --trainer-ranks "$RANKS" --prompts-per-step 2 \
    --rollout-n 4 --rollout-max-new-tokens 16 --rollout-temperature 1.0 --rollout-top-logprobs-num "$K" \
    --max-inflight-steps 2 --learning-rate 1e-5 --engine-device cuda \
    --sglang-args=--mem-fraction-static=0.3 >"$WORK/up.log" 2>&1; then
    tail -n 30 "$WORK/up.log"
    fail "centerline up exited non-zero; see $WORK/up.log and $RUN/logs/"
fi
pass "centerline up: $STEPS steps, exit 0"

DEVICES=$(grep -o "rank [0-9]* of [0-9]* trains on [a-z:0-9]*" "$RUN/logs/trainer.log" | sort -u || true)
echo "$DEVICES"
for r in $(seq 0 $((RANKS - 1))); do
    echo "$DEVICES" | grep -q "rank $r of $RANKS trains on cuda:$r" || fail "trainer rank $r did not train on cuda:$r"
done
pass "every trainer rank trained on its own GPU"

"$PY" - "$RUN" "$STEPS" "$K" <<'EOF' || fail "the run's figures; see above"
import json, sys, tomllib
from pathlib import Path

run, steps, k = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
assert [s["step"] for s in lines] == list(range(1, steps + 1)), [s["step"] for s in lines]
assert all(s["trained_tokens"] > 0 and s["step_skipped_nonfinite"] == 0 for s in lines)
assert max(s["turns_mean"] for s in lines) > 1, "no step trained a session"
assert tomllib.loads((run / "config.toml").read_text())["rollout_top_logprobs_num"] == k
print(f"PASS: {steps} steps trained at K={k}: loss {[round(s['loss'], 4) for s in lines]}, "
      f"turns_mean {[round(s['turns_mean'], 2) for s in lines]}, staleness_max {[s['staleness_max'] for s in lines]}")
EOF

# 5. Teacher forcing: every sampled token against the weights its label names, on the GPU
PORT=$("$PY" -c "from centerline.ports import free_port; print(free_port())")
"$PY" -m centerline sglang --model "$MODEL" --port "$PORT" --device cuda -- --disable-radix-cache \
    --mem-fraction-static 0.3 >"$WORK/teacher-force-sglang.log" 2>&1 &
SERVER=$!
trap 'kill "$SERVER" 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$SERVER" 2>/dev/null || fail "SGLang for teacher forcing died; see $WORK/teacher-force-sglang.log"
    sleep 1
done
"$PY" -m centerline teacher-force "$RUN" --engine "http://127.0.0.1:$PORT" --out "$WORK/teacher_force.json" \
    >"$WORK/teacher-force.log" 2>&1 || fail "centerline teacher-force; see $WORK/teacher-force.log"
"$PY" - "$WORK/teacher_force.json" <<'EOF' || fail "teacher forcing found tokens its labels do not explain"
import json, sys

report = json.load(open(sys.argv[1]))
total = report["total"]
print(f"teacher forcing: {report['batches']} batches, {total['tokens']} tokens, {total['beyond']} beyond "
      f"{report['tolerance']} (max {total.get('max')}); wrong label: {report['wrong_label']['total']}")
assert total["tokens"] > 0 and total["beyond"] == 0
EOF
pass "teacher forcing: every sampled token matches the weights its label names"
echo "PASS: gpu_check ($WORK)"
