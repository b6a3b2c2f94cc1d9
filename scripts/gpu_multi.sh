#!/usr/bin/env bash
# Issue #21's GPU figures on one machine of several GPUs (not part of CI): tensor parallelism
# against one GPU, a model too big for one GPU, and data-parallel replicas against one engine.
#
#   TOK=<a tokenizer directory> bash scripts/gpu_multi.sh [tp] [big] [dp] [ar] [http]   (default: all that fit)
#
# tp    benchmarks/tp_bench.py: TP=2 fp32 logits against TP=1 on dummy:llama-3.1-8b (goal <= 1e-4) and
#       the nano-vllm workload in bf16 at TP=1 and TP=2 (goal >= 1.6x)                  (2 GPUs)
# big   benchmarks/tp_bench.py --part big: a 70B Llama shape served at TP=4              (4 GPUs)
# dp    benchmarks/dp_bench.py: the chat workload (128 users x 4 turns on 4 public personas) on one
#       engine (AsyncLLM and one replica) and on 2 replicas, then at 512 users (one replica full) one
#       replica against 2 (goal >= 1.8x, the prefix hit rate kept); needs TOK (a random
#       llama-3.2-1b around that tokenizer is made with benchmarks/random_hf_model.py)   (2 GPUs)
# ar    benchmarks/allreduce_bench.py: a decode step's 65 all-reduces alone, per NCCL protocol    (2 GPUs)
#       and benchmarks/tp_bench.py --part profile: eager decode steps at TP=1 and TP=2 under torch.profiler
# http  benchmarks/serve_bench.py: 256 concurrent streams through the API with the engine in a process
#       of its own (serve --engine-process) against AsyncLLM directly (issue #20's goal: >= 0.9x)
#
# Each step has its own time limit (STEP_TIMEOUT seconds, default 540) so that one device command can
# run a part without losing the others' results. Results go to benchmarks/results/.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast off in NCCL, torch's symmetric memory and NVSHMEM: the GPU machines require it
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
parts=("$@")
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(tp dp http)
  [ "$gpus" -ge 4 ] && parts+=(big)
fi
limit="${STEP_TIMEOUT:-540}"
step() { echo "+ $*"; timeout "$limit" "$@" || echo "step failed or timed out (rc $?): $*"; }
for part in "${parts[@]}"; do
  case "$part" in
    tp) step python benchmarks/tp_bench.py --part logits throughput --shape llama-3.1-8b --tp 2 ;;
    big) step python benchmarks/tp_bench.py --part big --big-shape llama-3.1-70b --big-tp 4 ;;
    ar)
      step python benchmarks/allreduce_bench.py --ranks 2
      step python benchmarks/tp_bench.py --part profile ;;
    dp)
      if [ -z "${TOK:-}" ]; then echo "dp needs TOK=<tokenizer dir>"; continue; fi
      [ -d /tmp/m1b ] || step python benchmarks/random_hf_model.py --tokenizer "$TOK" --shape llama-3.2-1b --out /tmp/m1b
      step python benchmarks/dp_bench.py --model /tmp/m1b --replicas 2 --one both
      step python benchmarks/dp_bench.py --model /tmp/m1b --replicas 2 --one replica --users 512 ;;
    http)
      step python benchmarks/serve_bench.py --targets async http --cache on --rates 20 --requests 200 \
        --concurrency 256 --engine-process ;;
    *) echo "unknown part $part (tp, big, dp, ar, http)"; exit 2 ;;
  esac
done
