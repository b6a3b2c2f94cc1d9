#!/usr/bin/env bash
# #22's determinism counts -- 200 targets among 255 neighbours, dummy:llama-3.2-1b and
# dummy:qwen2.5-0.5b, default and deterministic mode -- over the GPUs of one host, within one device
# call: each model and mode on a GPU of its own (round-robin over fewer GPUs), in SHARDS processes side
# by side (`determinism_bench.py --shard k/SHARDS`, fixed KV pools so that they share the GPU), each
# cut at LIMIT_S seconds with its counts so far kept, then added up (`--merge`) into OUT.
#
#   bash benchmarks/determinism_shards.sh [OUT=benchmarks/results] [SHARDS=4] [LIMIT_S=540] [MODES="deterministic default"]
#
# A process takes ~15 GB of GPU memory (20000 pages of Llama-1B KV): SHARDS of them share a GPU when
# there are 4 GPUs (of 80 GB); with fewer, lower SHARDS or run the models one after another.
set -uo pipefail
out=$(realpath -m "${1:-benchmarks/results}")
cd "$(dirname "$0")/.."
shards=${2:-4}
limit=${3:-540}
modes=${4:-deterministic default}
gpus=(${CUDA_VISIBLE_DEVICES:-})
gpus=(${gpus[@]//,/ })
[ ${#gpus[@]} -gt 0 ] || mapfile -t gpus < <(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null)
[ ${#gpus[@]} -gt 0 ] || { echo "no GPU" >&2; exit 1; }
# the shards' disk stores (case e's restart reads each shard's targets back: GBs a shard) in memory
# where /dev/shm has room for them all, so that a slow disk does not set the pace
base=/tmp
[ "$(df --output=avail -BG /dev/shm 2>/dev/null | tail -1 | tr -dc 0-9)" -ge 64 ] 2>/dev/null && base=/dev/shm
tmp=$(mktemp -d "$base/det-shards.XXXX")
export TMPDIR=$tmp  # removed below, also the stores of shards cut at the limit
# many engines on one host: each with a few CPU threads, not one per core (their copies of pages
# to the disk store are small parallel regions, which oversubscribed threads turn into waits)
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
echo "disk stores under $base"
i=0
for combo in "dummy:llama-3.2-1b deterministic 20000" "dummy:llama-3.2-1b default 20000" \
  "dummy:qwen2.5-0.5b deterministic 30000" "dummy:qwen2.5-0.5b default 30000"; do
  read -r model mode pages <<< "$combo"
  [[ " $modes " == *" $mode "* ]] || continue
  for ((k = 0; k < shards; k++)); do
    CUDA_VISIBLE_DEVICES=${gpus[$((i % ${#gpus[@]}))]} timeout "$limit" python benchmarks/determinism_bench.py --models "$model" \
      --modes "$mode" --num-kv-blocks "$pages" --shard "$k/$shards" --out "$tmp" > "$tmp/log-$i-$k.txt" 2>&1 &
  done
  i=$((i + 1))
done
wait
for f in "$tmp"/log-*.txt; do echo "$(basename "$f"): $(grep '\[dummy' "$f" | tail -1)"; done
grep -h "Error" "$tmp"/log-*.txt | head -8
rm -rf "$tmp"/det-kv-*
python benchmarks/determinism_bench.py --merge "$tmp"/*.json --out "$out"
echo "shards' logs and results: $tmp"
