#!/usr/bin/env bash
# Prefill/decode disaggregation on two GPUs (prefill on GPU 0, decode on GPU 1, KV through a store directory)
# vs two `both` instances on the same GPUs behind the same router (issue 15's P/D run; docs/serving.md).
# Llama-3-8B width with random bf16 weights (LAYERS layers, default 32), one `openinfer bench serve` workload.
#
#   TOK=path/to/tokenizer.json OUT=results_dir bash benchmarks/gpu_pd_two_gpus.sh
#
# Needs `openinfer` importable (python3 -m openinfer) with its serving dependencies: fastapi >= 0.16x imports
# opentelemetry-api (carry it, and importlib-metadata, to a machine without them).
set -u
OUT=${OUT:-.}; LAYERS=${LAYERS:-32}; RATE=${RATE:-4}; PROMPTS=${PROMPTS:-120}
OI="python3 -m openinfer"
D=$(python3 -c "import sys,os; sys.path.insert(0,'benchmarks'); from gpu_llama8b import model_dir, LLAMA3_8B; \
print(model_dir(os.environ['TOK'], dict(LLAMA3_8B, num_hidden_layers=$LAYERS)))")
S=$(mktemp -d /tmp/openinfer-kvstore-XXXX)
ENG="--model $D --load-format dummy --dtype bfloat16 --max-model-len 8192 --served-model-name llama8b --max-num-seqs 64"
BENCH="--endpoint completions --model-name llama8b --request-rate $RATE --input-len 1024 --output-len 128 \
--slo-ttft-ms 1000 --slo-tpot-ms 50"
up() {  # port pid: wait for /health while the process lives
  python3 - "$1" "$2" <<'PY'
import os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
for _ in range(300):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
        sys.exit(0)
    except Exception:
        try:
            os.kill(pid, 0)
        except OSError:
            sys.exit(f"the process on port {port} died (see its log)")
        time.sleep(1)
sys.exit(f"port {port} never answered")
PY
}
bench() {  # name
  $OI bench serve --base-url http://127.0.0.1:8080 $BENCH --num-prompts 16 > /dev/null 2>&1   # warm-up (compiles)
  $OI bench serve --base-url http://127.0.0.1:8080 $BENCH --num-prompts $PROMPTS --result-json "$OUT/$1.json"
}
stop() { kill "$@" 2>/dev/null; sleep 5; kill -9 "$@" 2>/dev/null; wait 2>/dev/null; }

echo "== P/D: prefill GPU 0, decode GPU 1, store $S"
CUDA_VISIBLE_DEVICES=0 $OI serve $ENG --role prefill --kv-store-dir "$S" --port 8001 > "$OUT/pd_prefill.log" 2>&1 & P=$!
CUDA_VISIBLE_DEVICES=1 $OI serve $ENG --role decode --kv-store-dir "$S" --port 8002 > "$OUT/pd_decode.log" 2>&1 & Q=$!
if up 8001 $P && up 8002 $Q; then
  $OI router --prefill http://127.0.0.1:8001 --decode http://127.0.0.1:8002 --port 8080 > "$OUT/pd_router.log" 2>&1 & R=$!
  up 8080 $R && bench pd
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8002/load').read().decode())"
  stop $R
fi
stop $P $Q

echo "== two both instances (GPU 0, GPU 1) behind the router"
CUDA_VISIBLE_DEVICES=0 $OI serve $ENG --port 8003 > "$OUT/both0.log" 2>&1 & P=$!
CUDA_VISIBLE_DEVICES=1 $OI serve $ENG --port 8004 > "$OUT/both1.log" 2>&1 & Q=$!
if up 8003 $P && up 8004 $Q; then
  $OI router --both http://127.0.0.1:8003 http://127.0.0.1:8004 --port 8080 > "$OUT/both_router.log" 2>&1 & R=$!
  up 8080 $R && bench both2
  stop $R
fi
stop $P $Q
rm -rf "$S"
