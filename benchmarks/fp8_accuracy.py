"""How far FP8 weights (quantization="fp8") move a model's answers from its bf16 self, same weights.

For --prompts random prompts (100..1000 ids): the logprob every prompt token gets (prefill) under
bf16 and under fp8, and the first --tokens greedy tokens. Reports the largest and the mean
|logprob difference|, how many greedy continuations are identical, and the mean share of tokens
that agree before the first divergence. Dummy weights are random, so their distributions are flat
and near-ties common: on a trained model agreement is higher; these figures bound the arithmetic.
Saves JSON + markdown under --out.

    python benchmarks/fp8_accuracy.py [--model dummy:llama-3.1-8b] [--prompts 32 --tokens 64]
"""

import argparse
import gc
import json
import random
import statistics
import sys
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402


def run(model: str, prompts: list[list[int]], tokens: int, dtype: str = "bfloat16", **kw) -> tuple[list, list]:
    llm = LLM(model, dtype=dtype, register_personas=False, max_model_len=2048, **kw)
    try:
        prefill = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
        logprobs = [[d[t] for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(prefill, prompts)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True))
        greedy = [o.outputs[0].token_ids for o in outs]
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    return logprobs, greedy


def agree_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="dummy:llama-3.1-8b")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--max-id", type=int, default=10000, help="prompt ids below this (tiny models: their vocab)")
    ap.add_argument("--fp32-baseline", action="store_true", help="also run fp32: bf16's and fp8's distance from it")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, args.max_id) for _ in range(rng.randint(100, 1000))] for _ in range(args.prompts)]
    lp16, g16 = run(args.model, prompts, args.tokens)
    lp8, g8 = run(args.model, prompts, args.tokens, quantization="fp8")
    diffs = [abs(a - b) for pa, pb in zip(lp16, lp8) for a, b in zip(pa, pb)]
    prefix = [agree_prefix(a, b) / args.tokens for a, b in zip(g16, g8)]
    baseline = {}
    if args.fp32_baseline:  # how far bf16 itself is from fp32 on these weights: the scale to read fp8's by
        lp32, g32 = run(args.model, prompts, args.tokens, dtype="float32")
        for name, (lp, g) in {"bf16": (lp16, g16), "fp8": (lp8, g8)}.items():
            d = [abs(a - b) for pa, pb in zip(lp32, lp) for a, b in zip(pa, pb)]
            baseline[f"{name}_vs_fp32_logprob_abs_diff_mean"] = statistics.mean(d)
            baseline[f"{name}_vs_fp32_logprob_abs_diff_max"] = max(d)
            baseline[f"{name}_vs_fp32_greedy_identical"] = sum(a == b for a, b in zip(g32, g))
    res = {
        "model": args.model,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "commit": commit(),
        "torch": torch.__version__,
        "prompts": args.prompts,
        "tokens": args.tokens,
        "prompt_tokens": len(diffs),
        "logprob_abs_diff_max": max(diffs),
        "logprob_abs_diff_mean": statistics.mean(diffs),
        "greedy_identical": sum(a == b for a, b in zip(g16, g8)),
        "greedy_agree_before_divergence_mean": statistics.mean(prefix),
        **baseline,
    }
    stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H%M")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = f"fp8_accuracy-{stamp}-{res['commit']}"
    (out / f"{name}.json").write_text(json.dumps(res, indent=1))
    md = "\n".join(f"| {k} | {v} |" for k, v in res.items())
    (out / f"{name}.md").write_text("| | |\n|---|---|\n" + md + "\n")
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
