"""Tensor parallelism on GPUs: logits against one GPU, and throughput.

    python benchmarks/tp_bench.py [--parts logits,throughput] [--shape llama-3.1-8b] [--tp 2]

- logits: the prefill logits of a few prompts at TP=1 and TP=N, fp32, on the same dummy weights;
  prints the largest absolute difference (the promise: within 1e-4).
- throughput: the nano-vllm workload (256 requests, prompt and output lengths uniform in
  [100, 1024], bf16, temperature 0.6, ignore_eos) at TP=1 and TP=N in the same run; output tokens/s
  and the ratio.

Needs N GPUs (NVLink multicast stays off). Saves JSON + markdown under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402
from chatengine.engine.sequence import Sequence  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def nano_workload(n: int = 256, seed: int = 0, max_in: int = 1024, max_out: int = 1024):
    """nano-vllm's bench.py workload, the same RNG calls: (prompt ids, output lengths)."""
    import random

    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_in))] for _ in range(n)]
    outs = [rng.randint(100, max_out) for _ in range(n)]
    return prompts, outs


def engine(shape: str, tp: int, dtype: str, **kw) -> LLM:
    cfg = dict(
        device="cuda",
        dtype=dtype,
        tensor_parallel_size=tp,
        max_num_seqs=256,
        max_num_batched_tokens=8192,
        max_model_len=4096,
        register_personas=False,
        gpu_memory_utilization=0.85,
        cpu_offload_gib=0,
    )
    return LLM(f"dummy:{shape}", **{**cfg, **kw})


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """(len(prompts), vocab) fp32 logits of each prompt's last token, straight from the runner."""
    runner, bs, first, rows = llm.engine.runner, llm.engine.config.block_size, 0, []
    for p in prompts:
        seq = Sequence(p, SamplingParams(), block_size=bs)
        n = -(-len(p) // bs)
        seq.block_table, first = list(range(first, first + n)), first + n
        logits, _, _ = runner._forward([seq], [len(p)])
        rows.append(logits[-1].float().cpu())
    return torch.stack(rows)


def part_logits(args, res) -> None:
    prompts = nano_workload(8, seed=1, max_in=512)[0]
    got = {}
    for tp in (1, args.tp):
        llm = engine(args.shape, tp, "float32", enforce_eager=True)
        got[tp] = prefill_logits(llm, prompts)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    diff = (got[1] - got[args.tp]).abs()
    res["logits"] = {
        "prompts": len(prompts),
        "max_abs_diff": diff.max().item(),
        "mean_abs_diff": diff.mean().item(),
        "logit_scale": got[1].abs().max().item(),
        "same_argmax": bool((got[1].argmax(-1) == got[args.tp].argmax(-1)).all()),
    }
    print(json.dumps(res["logits"]), flush=True)


def part_throughput(args, res) -> None:
    prompts, outs = nano_workload(args.num_requests)
    res["throughput"] = {}
    for tp in (1, args.tp):
        llm = engine(args.shape, tp, "bfloat16")
        llm.generate(prompts[:8], SamplingParams(max_tokens=8))  # warm-up
        params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outs]
        t = time.perf_counter()
        results = llm.generate(prompts, params)
        dt = time.perf_counter() - t
        n = sum(len(r.outputs[0].token_ids) for r in results)
        res["throughput"][f"tp{tp}"] = {"seconds": dt, "output_tokens": n, "tok_s": n / dt}
        print(f"TP={tp}: {n / dt:,.0f} output tok/s ({dt:.1f} s)", flush=True)
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    t = res["throughput"]
    t["ratio"] = t[f"tp{args.tp}"]["tok_s"] / t["tp1"]["tok_s"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", default="logits,throughput")
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--num-requests", type=int, default=256)
    args = p.parse_args(argv)
    res: dict = {
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "shape": args.shape,
        "tp": args.tp,
    }
    if "logits" in args.parts:
        part_logits(args, res)
    if "throughput" in args.parts:
        part_throughput(args, res)
    out = ROOT / "benchmarks" / "results" / f"tp_bench-{datetime.now(UTC):%Y-%m-%dT%H%M}-{res['commit']}.json"
    out.write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
