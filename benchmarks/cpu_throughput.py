"""CPU throughput: aggregate output tokens/s for 1, 4 and 16 concurrent chat requests on the default
model, against Hugging Face transformers `generate` run on the same prompts, one at a time, in the
same process. Saves JSON + a markdown table under benchmarks/results/.

    python benchmarks/cpu_throughput.py [--max-tokens 64] [--concurrency 1 4 16] [--repeats 3]
"""
import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chatengine import LLM, SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers.",
    "Explain what a KV cache is.", "Give me a recipe for pancakes.", "Why is the sky blue?",
    "Summarise the plot of Hamlet.", "How do I reverse a list in Python?", "What is photosynthesis?",
    "Tell me a joke about cats.", "Name three rivers in Europe.", "What does a CPU do?",
    "How far is the moon?", "Suggest a name for a bakery.", "What is 17 times 23?", "Describe a sunset.",
]


def commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, cwd=Path(__file__).parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (EOS ignored)")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="concurrent requests")
    ap.add_argument("--repeats", type=int, default=3, help="timed repeats per point (median reported)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for results")
    args = ap.parse_args(argv)

    # the prefix cache is off: every run recomputes its prompts, as generate() does
    llm = LLM(enable_prefix_caching=False, max_num_batched_tokens=1024, kv_cache_gib=0.5)
    tok = llm.get_tokenizer()
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(llm.engine.hf_dir, dtype=torch.float32).eval()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                       tokenize=True) for q in QUESTIONS]
    prompts = [list(p["input_ids"] if hasattr(p, "keys") else p) for p in prompts]
    n_out = args.max_tokens
    sp = SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True)

    def ours(c):
        t = time.perf_counter()
        outs = llm.generate(prompts[:c], sp)
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == n_out for o in outs)
        return c * n_out / dt

    @torch.inference_mode()
    def peer(c):
        t = time.perf_counter()
        for p in prompts[:c]:
            out = hf.generate(torch.tensor([p]), max_new_tokens=n_out, min_new_tokens=n_out, do_sample=False,
                              pad_token_id=tok.eos_token_id)
            assert out.shape[1] - len(p) == n_out
        return c * n_out / (time.perf_counter() - t)

    ours(2), peer(1)  # warm-up
    rows = []
    for c in args.concurrency:
        o, p = [], []
        for _ in range(args.repeats):      # interleaved, so both see the same machine state
            o.append(ours(c))
            p.append(peer(c))
        row = {"concurrency": c, "ours_tok_s": statistics.median(o), "hf_sequential_tok_s": statistics.median(p),
               "ours_runs": o, "hf_runs": p}
        row["ratio"] = row["ours_tok_s"] / row["hf_sequential_tok_s"]
        rows.append(row)
        print(f"c={c:3d}  ours {row['ours_tok_s']:8.1f} tok/s   HF generate (sequential) "
              f"{row['hf_sequential_tok_s']:7.1f} tok/s   ratio {row['ratio']:.2f}x", flush=True)

    meta = {"benchmark": "cpu_throughput", "model": llm.stats()["model"], "dtype": "float32",
            "max_tokens": n_out, "repeats": args.repeats, "commit": commit(),
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                        "cpu_count": torch.get_num_threads(), "python": platform.python_version()},
            "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
            "command": "python benchmarks/cpu_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"cpu_throughput-{meta['date'][:10]}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "results": rows}, indent=1))
    lines = [f"# CPU throughput — {meta['model']} fp32, {n_out} output tokens per request",
             "", f"commit {meta['commit']}, {meta['date']}, {meta['machine']['processor']}, "
             f"{meta['machine']['cpu_count']} threads, torch {meta['versions']['torch']}, "
             f"transformers {meta['versions']['transformers']}; median of {args.repeats}",
             "", "| concurrent requests | chatengine tok/s | HF generate, sequential, tok/s | ratio |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['concurrency']} | {r['ours_tok_s']:.1f} | {r['hf_sequential_tok_s']:.1f} | {r['ratio']:.2f}x |"
              for r in rows]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"saved {stem}.json and .md")


if __name__ == "__main__":
    main()
