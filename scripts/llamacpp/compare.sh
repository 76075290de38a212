#!/bin/sh
# compare.sh: measures kvbridge and llama.cpp on this machine, cell by cell, the two
# engines alternated (round 1 kvbridge first, round 2 llama.cpp first, ...), and prints
# the table (table.py): tok/s of each engine, kvbridge ÷ llama.cpp, and both engines'
# ratios to the read bandwidth kvbridge probed beside the same cell.
#
# Cells (kvbridge bench engine's): prefill of a 1024-token prompt; batch-1 decode of 32
# tokens after it (llama-bench -d 1024 -n 32); batch 1 at context 128 (-d 128 -n 32);
# batch 8 and 32 at context 128 (llama-batched-bench -npp 128 -ntg 32 -npl 8,32; -pps
# prefills the 128 tokens once and copies them to each sequence's own KV stream).
# Both engines use THREADS threads (default 2: GOMAXPROCS for kvbridge, -t for
# llama.cpp); weights and KV as docs/performance.md, "Against llama.cpp on this
# machine", describes.
#
# Needs: the kvbridge binary (go build -o /tmp/llamacpp-kvb ./cmd/kvbridge), the
# checkpoint /tmp/qwen3-0.6b, llama.cpp's binaries (build.sh), and the GGUFs
# (convert.py --outtype bf16 / f32, then llama-quantize bf16 → Q8_0), python3.
# Usage: compare.sh [rounds] (default 3); DTYPES="bfloat16 int8 float32" picks cells,
# THREADS=1 runs both engines on one thread (no barriers: see docs/performance.md).
set -eu
ROUNDS=${1:-3}
DTYPES=${DTYPES:-bfloat16 int8 float32}
THREADS=${THREADS:-2}
KVB=${KVB:-/tmp/llamacpp-kvb}
MODEL=${MODEL:-/tmp/qwen3-0.6b}
BIN=${BIN:-/tmp/llama.cpp/build/bin}
GGUF=${GGUF:-/tmp/llamacpp-qwen3}
OUT=${OUT:-/tmp/llamacpp-compare}
mkdir -p "$OUT"

kvbridge() { # dtype round
	case $1 in
	int8) set -- bfloat16 "$2" --quantization int8 int8 ;;
	*) set -- "$1" "$2" --quantization none "$1" ;;
	esac
	GOMAXPROCS=$THREADS "$KVB" bench engine --model "$MODEL" --dtype "$1" $3 $4 --prompt-len 1024 \
		--decode-tokens 32 --batch 1,8,32 --decode-context 128 --decode-steps 8 --repeat 2 \
		--json "$OUT/r$2-$5-kvb.json" >"$OUT/r$2-$5-kvb.txt" 2>&1
}

llamacpp() { # dtype round
	case $1 in
	bfloat16) m=$GGUF-bf16.gguf kv="-ctk f16 -ctv f16" ;;
	int8) m=$GGUF-q8_0.gguf kv="-ctk f16 -ctv f16" ;;
	float32) m=$GGUF-f32.gguf kv="-ctk f16 -ctv f16" ;; # llama-bench has no f32 KV
	esac
	"$BIN/llama-bench" -m "$m" -t "$THREADS" -r 1 $kv -p 1024 -n 0 -o json >"$OUT/r$2-$1-pp.json" 2>/dev/null
	"$BIN/llama-bench" -m "$m" -t "$THREADS" -r 2 $kv -p 0 -n 32 -d 128,1024 -o json >"$OUT/r$2-$1-tg.json" 2>/dev/null
	"$BIN/llama-batched-bench" -m "$m" -t "$THREADS" $kv -c 5120 -npp 128 -ntg 32 -npl 8,32 -pps \
		--output-format jsonl >"$OUT/r$2-$1-bb.jsonl" 2>"$OUT/r$2-$1-bb.log"
}

r=${FIRST:-1} # FIRST=2 adds rounds to an earlier OUT, llama.cpp first
while [ "$r" -lt "$((${FIRST:-1} + ROUNDS))" ]; do
	for dt in $DTYPES; do
		echo "round $r $dt: $(uptime | sed 's/.*load/load/')"
		if [ $((r % 2)) -eq 1 ]; then
			kvbridge "$dt" "$r"; llamacpp "$dt" "$r"
		else
			llamacpp "$dt" "$r"; kvbridge "$dt" "$r"
		fi
	done
	r=$((r + 1))
done
python3 "$(dirname "$0")/table.py" "$OUT"
