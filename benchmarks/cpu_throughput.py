"""CPU throughput: aggregate output tokens/s for 1, 4 and 16 concurrent chat requests on the default
model, against Hugging Face transformers `generate` run on the same prompts, one at a time, in the
same process. Saves JSON + a markdown table under benchmarks/results/.

    python benchmarks/cpu_throughput.py [--max-tokens 64] [--concurrency 1 4 16] [--repeats 3]
                                        [--hf-repeats 1] [--threads 1]

HF runs sequentially, so its time for c requests is the sum of its times for the first c prompts:
each prompt is generated once per HF repeat (the per-prompt minimum is kept) and every concurrency
reuses those times, instead of regenerating 1 + 4 + 16 prompts per repeat. Ours runs each point
`--repeats` times (median). Both see the same torch thread count (`--threads`; 0 keeps torch's
default): on a small shared machine, 2 OpenMP threads make every parallel op wait for a thread that
another process has descheduled (~10 ms each), which slows both engines several-fold and at random.
Our greedy tokens are checked against HF's for every prompt up to our first EOS (`greedy_match`:
HF's min_new_tokens bans EOS, while ours, with ignore_eos, may emit it and go on).
"""

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a KV cache is.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
    "How do I reverse a list in Python?",
    "What is photosynthesis?",
    "Tell me a joke about cats.",
    "Name three rivers in Europe.",
    "What does a CPU do?",
    "How far is the moon?",
    "Suggest a name for a bakery.",
    "What is 17 times 23?",
    "Describe a sunset.",
]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent requests")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats of ours per point (median reported)")
    ap.add_argument("--hf-repeats", type=int, default=1, help="HF generations per prompt (minimum kept)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads for both engines (0: torch's default)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for results")
    args = ap.parse_args(argv)
    if max(args.concurrency) > len(QUESTIONS):
        ap.error(f"at most {len(QUESTIONS)} concurrent requests (one prompt each)")
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()

    def progress(msg):
        print(f"[{time.perf_counter() - t_start:6.1f}s] {msg}", flush=True)

    # the prefix cache is off: every run recomputes its prompts, as generate() does
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=1024, kv_cache_gib=0.5)
    tok = llm.get_tokenizer()
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(llm.engine.hf_dir, dtype=torch.float32).eval()
    progress(f"loaded; {torch.get_num_threads()} torch threads")
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in QUESTIONS
    ]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    n_out, c_max = args.max_tokens, max(args.concurrency)
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)

    def ours(c):
        t = time.perf_counter()
        outs = llm.generate(prompts[:c], sp)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n_out for o in outs)
        return c * n_out / dt, [list(o.outputs[0].token_ids) for o in outs]

    @torch.inference_mode()
    def peer(p):
        t = time.perf_counter()
        out = hf.generate(
            torch.tensor([p]),
            max_new_tokens=n_out,
            min_new_tokens=n_out,
            do_sample=False,
            pad_token_id=tok.eos_token_id,
        )
        dt = time.perf_counter() - t
        assert out.shape[1] - len(p) == n_out
        return dt, out[0, len(p) :].tolist()

    ours(2), peer(prompts[0][:8])  # warm-up
    hf_times, hf_tokens = [float("inf")] * c_max, [None] * c_max
    for r in range(args.hf_repeats):
        for i in range(c_max):
            dt, hf_tokens[i] = peer(prompts[i])
            hf_times[i] = min(hf_times[i], dt)
        progress(
            f"HF generate, repeat {r + 1}/{args.hf_repeats}: {c_max} prompts x {n_out} tokens in "
            f"{sum(hf_times):.1f} s ({c_max * n_out / sum(hf_times):.1f} tok/s)"
        )

    rows, ours_tokens = [], [None] * c_max
    for c in args.concurrency:
        o = []
        for _ in range(args.repeats):
            tps, toks = ours(c)
            o.append(tps)
            ours_tokens[:c] = toks
        hf_tps = c * n_out / sum(hf_times[:c])
        row = {
            "concurrency": c,
            "ours_tok_s": statistics.median(o),
            "hf_sequential_tok_s": hf_tps,
            "ours_runs": o,
            "hf_prompt_s": hf_times[:c],
        }
        row["ratio"] = row["ours_tok_s"] / row["hf_sequential_tok_s"]
        rows.append(row)
        progress(
            f"c={c:3d}  ours {row['ours_tok_s']:8.1f} tok/s   HF generate (sequential) "
            f"{row['hf_sequential_tok_s']:7.1f} tok/s   ratio {row['ratio']:.2f}x"
        )
    # HF's min_new_tokens bans EOS, ours (ignore_eos) may pick it and go on: compare up to our first EOS
    eos = llm.engine.eos_token_ids

    def until_eos(ids):
        return ids[: next((j for j, t in enumerate(ids) if t in eos), len(ids))]

    match = sum(until_eos(a) == b[: len(until_eos(a))] for a, b in zip(ours_tokens, hf_tokens) if a is not None)
    progress(f"greedy tokens equal to HF's (up to EOS): {match}/{c_max} prompts")

    meta = {
        "benchmark": "cpu_throughput",
        "model": llm.stats()["model"],
        "dtype": "float32",
        "max_tokens": n_out,
        "repeats": args.repeats,
        "hf_repeats": args.hf_repeats,
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": torch.get_num_threads(),
            "cores": len(os.sched_getaffinity(0)),
            "python": platform.python_version(),
        },
        "threads": torch.get_num_threads(),
        "greedy_match": f"{match}/{c_max}",
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "command": "python benchmarks/cpu_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_throughput-{meta['date'][:16].replace(':', '')}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=1))
    lines = [
        f"# CPU throughput — {meta['model']} fp32, {n_out} output tokens per request",
        "",
        f"commit {meta['commit']}, {meta['date']}, {meta['machine']['processor']}, "
        f"{meta['machine']['cores']} cores, {meta['threads']} torch threads (both engines), "
        f"torch {meta['versions']['torch']}, transformers {meta['versions']['transformers']}; "
        f"ours: median of {args.repeats}; HF: per-prompt minimum of {args.hf_repeats}, summed over "
        f"the first c prompts; greedy tokens equal to HF's (up to EOS) on {match}/{c_max} prompts",
        "",
        "| concurrent requests | chatengine tok/s | HF generate, sequential, tok/s | ratio |",
        "|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['concurrency']} | {r['ours_tok_s']:.1f} | {r['hf_sequential_tok_s']:.1f} | {r['ratio']:.2f}x |"
        for r in rows
    ]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    progress(f"saved {stem}.json and .md")


if __name__ == "__main__":
    main()
