"""CPU: our engine against llama.cpp (llama-cpp-python) and transformers on the same GGUF, the
embedded SmolLM2-135M-Instruct Q4_1 (issue #23). Each engine runs in its own process per round
(peak RSS is that process's), rounds alternate between engines, medians are reported, with ratios
against llama.cpp measured in the same run. Saves JSON + a markdown table under benchmarks/results/.

    python benchmarks/cpu_bench.py [--rounds 5] [--threads 2] [--max-tokens 128] [--streams 8]
                                   [--engines ours ours-none ours-q4_0 llamacpp llamacpp-q4_0 hf]

Engines: ours (the GGUF's own blocks, q4_1: what `chatengine serve` runs by default), ours-<fmt>
(quantization=<fmt>: none is fp32, q4_0 re-quantizes at load), llamacpp (the same Q4_1 file),
llamacpp-q4_0, hf (transformers, fp32). The decode GEMV's arithmetic follows
CHATENGINE_CPU_ACTIVATIONS (auto by default: q16; fp32; q8: llama.cpp's), inherited by
the workers.

Per engine and round: single-stream greedy decode tok/s (`--max-tokens` new tokens, EOS ignored,
prefill excluded: time of the first token subtracted), TTFT on a ~1k-token prompt, aggregate tok/s
of `--streams` concurrent greedy streams (ours: one engine batch; llama.cpp: one llama_decode per
step over n_seq_max sequences through its low-level API; transformers: one padded generate batch),
and the process's peak RSS. llama.cpp's Q4_0 file is its own re-quantization of the Q4_1 file
(llama_model_quantize, allow_requantize); ours-q4_0 re-quantizes the de-quantized weights at load.
Agreement: the greedy tokens of our quantized path (--quantization gguf) against our fp32 path
(quantization="none") on the benchmark prompts: the share of the first `--agree-tokens` positions
before the first difference, over all prompts.
"""

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from benchmarks.common import commit  # noqa: E402

QUESTIONS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Summarise the plot of Hamlet.",
    "Describe a sunset over the sea.",
    "What does a CPU do?",
    "Tell me about the history of tea.",
]


def long_prompt(tokenizer, n=1000) -> list[int]:
    text = " ".join(f"Item {i}: the quick brown fox jumps over the lazy dog." for i in range(200))
    ids = tokenizer(text)["input_ids"]
    return list(ids[:n])


def chat_ids(tokenizer, q) -> list[int]:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def gguf_q4_0(src: Path) -> Path:
    """llama.cpp's own Q4_0 re-quantization of `src`, made once in the cache."""
    import llama_cpp

    from chatengine.engine.loader import cache_dir

    out = cache_dir() / "bench" / (src.stem.replace("Q4_1", "") + "requant.Q4_0.gguf")
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    params.nthread = 2
    tmp = out.with_suffix(".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params) != 0:
        raise RuntimeError("llama_model_quantize failed")
    os.replace(tmp, out)
    return out


# -- workers: one engine in this process ------------------------------------------------------------


def work_ours(args, quantization):
    import torch

    from chatengine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    llm = LLM(quantization=quantization, register_personas=False, enable_prefix_caching=False)
    load_s = time.perf_counter() - t
    tok = llm.get_tokenizer()
    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    n = args.max_tokens
    sp = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4))  # warm-up

    def ttft(p):
        t = time.perf_counter()
        llm.generate([p], SamplingParams(temperature=0, max_tokens=1))
        return time.perf_counter() - t

    first = ttft(prompts[0])
    t = time.perf_counter()
    llm.generate([prompts[0]], sp)
    decode = (n - 1) / (time.perf_counter() - t - first)
    long = long_prompt(tok)
    ttft_long = ttft(long)
    t = time.perf_counter()
    llm.generate(prompts[: args.streams], sp)
    streams = args.streams * n / (time.perf_counter() - t)
    return {
        "load_s": load_s,
        "decode_tok_s": decode,
        "ttft_s": ttft_long,
        "prompt_tokens": len(long),
        "streams_tok_s": streams,
        "quantization": llm.engine.runner.quantization,
    }


def work_llamacpp(args, path):
    import ctypes

    import llama_cpp
    import numpy as np
    from transformers import AutoTokenizer

    from chatengine.engine.loader import load_model

    tok = AutoTokenizer.from_pretrained(load_model(None).hf_dir)  # the same token ids as ours
    t = time.perf_counter()
    llama_cpp.llama_backend_init()
    mparams = llama_cpp.llama_model_default_params()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), mparams)
    cparams = llama_cpp.llama_context_default_params()
    cparams.n_ctx = 4096
    cparams.n_batch = cparams.n_ubatch = 1024
    cparams.n_seq_max = args.streams
    cparams.kv_unified = True
    cparams.n_threads = cparams.n_threads_batch = args.threads
    ctx = llama_cpp.llama_init_from_model(model, cparams)
    load_s = time.perf_counter() - t
    vocab = llama_cpp.llama_model_get_vocab(model)
    n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
    batch = llama_cpp.llama_batch_init(1024, 0, args.streams)

    def clear():
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(ctx), True)

    def decode(items):  # items: (token, pos, seq, want_logits)
        batch.n_tokens = len(items)
        for i, (tk, pos, seq, want) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tk, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, want
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(i):
        ptr = llama_cpp.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), (n_vocab,)).argmax())

    def generate(prompts, n):  # greedy, all sequences one batch per step; returns (ttft, total)
        clear()
        t = time.perf_counter()
        items = [(tk, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, tk in enumerate(ids)]
        nxt = []
        for start in range(0, len(items), 1024):
            decode(items[start : start + 1024])
        # logits rows: the last item of each prompt, in batch order of the final chunk
        k = 0
        last_chunk = items[(len(items) - 1) // 1024 * 1024 :]
        for i, it in enumerate(last_chunk):
            if it[3]:
                nxt.append(argmax(i))
                k += 1
        assert k == len(prompts), "prompts must end in the last prefill chunk"
        first = time.perf_counter() - t
        pos = [len(p) for p in prompts]
        for _ in range(n - 1):
            decode([(nxt[s], pos[s], s, True) for s in range(len(prompts))])
            nxt = [argmax(s) for s in range(len(prompts))]
            pos = [p + 1 for p in pos]
        return first, time.perf_counter() - t

    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    n = args.max_tokens
    generate([prompts[0]], 4)  # warm-up
    first, total = generate([prompts[0]], n)
    decode_tps = (n - 1) / (total - first)
    long = long_prompt(tok)
    ttft, _ = generate([long], 1)
    _, total = generate(prompts[: args.streams], n)
    llama_cpp.llama_batch_free(batch)
    return {
        "load_s": load_s,
        "decode_tok_s": decode_tps,
        "ttft_s": ttft,
        "prompt_tokens": len(long),
        "streams_tok_s": args.streams * n / total,
        "file": path.name,
    }


def work_hf(args):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from chatengine.engine.loader import load_model

    torch.set_num_threads(args.threads)
    t = time.perf_counter()
    hf_dir = load_model(None).hf_dir
    tok = AutoTokenizer.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    load_s = time.perf_counter() - t
    n = args.max_tokens

    @torch.inference_mode()
    def gen(prompts, new):
        tok.padding_side = "left"
        width = max(map(len, prompts))
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        t = time.perf_counter()
        model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=pad
        )
        return time.perf_counter() - t

    prompts = [chat_ids(tok, q) for q in QUESTIONS]
    gen([prompts[0]], 4)
    first = gen([prompts[0]], 1)
    decode_tps = (n - 1) / (gen([prompts[0]], n) - first)
    long = long_prompt(tok)
    ttft = gen([long], 1)
    streams = args.streams * n / gen(prompts[: args.streams], n)
    return {
        "load_s": load_s,
        "decode_tok_s": decode_tps,
        "ttft_s": ttft,
        "prompt_tokens": len(long),
        "streams_tok_s": streams,
    }


def worker(args):
    from chatengine.engine.loader import default_gguf_path

    e = args.worker
    if e == "ours":
        r = work_ours(args, "gguf")  # the file's own blocks (q4_1 for the default model)
    elif e.startswith("ours-"):
        r = work_ours(args, e.removeprefix("ours-"))
    elif e == "llamacpp":
        r = work_llamacpp(args, default_gguf_path())
    elif e == "llamacpp-q4_0":
        r = work_llamacpp(args, gguf_q4_0(default_gguf_path()))
    elif e == "hf":
        r = work_hf(args)
    else:
        raise SystemExit(f"unknown engine {e}")
    r["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(r), flush=True)


def agreement(args):
    """Greedy tokens of our quantized path (the file's own blocks: quantization='gguf') against
    quantization='none', first args.agree_tokens."""
    import torch

    from chatengine import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    sp = SamplingParams(temperature=0, max_tokens=args.agree_tokens, ignore_eos=True)
    toks = {}
    for q in ("gguf", "none"):
        llm = LLM(quantization=q, register_personas=False)
        prompts = [chat_ids(llm.get_tokenizer(), x) for x in QUESTIONS]
        toks[q] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
        fmt = llm.engine.runner.quantization if q == "gguf" else q
        toks["fmt" if q == "gguf" else "x"] = fmt
        llm.shutdown()
    prefix = []
    for a, b in zip(toks["gguf"], toks["none"]):
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
        prefix.append(k)
    return {
        "default_quantization": toks["fmt"],
        "tokens_per_prompt": args.agree_tokens,
        "agreeing_prefix_per_prompt": prefix,
        "agreement": sum(prefix) / (len(prefix) * args.agree_tokens),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--agree-tokens", type=int, default=64)
    ap.add_argument("--engines", nargs="+", default=["ours", "ours-none", "llamacpp", "llamacpp-q4_0", "hf"])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    runs: dict[str, list[dict]] = {e: [] for e in args.engines}
    for r in range(args.rounds):
        order = args.engines if r % 2 == 0 else args.engines[::-1]  # alternate
        for e in order:
            cmd = [
                sys.executable,
                __file__,
                "--worker",
                e,
                "--threads",
                str(args.threads),
                "--max-tokens",
                str(args.max_tokens),
                "--streams",
                str(args.streams),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if line is None:
                raise SystemExit(f"{e} failed:\n{done.stderr[-3000:]}")
            runs[e].append(json.loads(line.removeprefix("RESULT ")))
            m = runs[e][-1]
            print(
                f"[{time.perf_counter() - t0:6.0f}s] round {r + 1} {e:14s} decode {m['decode_tok_s']:6.1f} tok/s  "
                f"ttft {m['ttft_s']:5.2f} s  {args.streams} streams {m['streams_tok_s']:6.1f} tok/s  "
                f"rss {m['peak_rss_mb']:5.0f} MB",
                flush=True,
            )
    keys = ["decode_tok_s", "ttft_s", "streams_tok_s", "peak_rss_mb", "load_s"]
    med = {e: {k: statistics.median(x[k] for x in runs[e]) for k in keys} for e in args.engines}
    agree = agreement(args)
    print(f"agreement of the default ({agree['default_quantization']}) with fp32: {agree['agreement']:.1%}")
    result = {
        "benchmark": "cpu_bench",
        "command": "python benchmarks/cpu_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": commit(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor(), "shared": True},
        "args": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "medians": med,
        "runs": runs,
        "agreement": agree,
    }
    lines = [
        f"# cpu_bench {result['date']} ({result['commit']})",
        "",
        f"`{result['command']}`: {args.rounds} alternating rounds, medians, {args.threads} threads, "
        f"{args.max_tokens} new tokens, {os.cpu_count()} CPUs (shared with other jobs: noisy).",
        "",
        f"| engine | decode tok/s | TTFT, {runs[args.engines[0]][0]['prompt_tokens']}-token prompt (s) | "
        f"{args.streams} streams tok/s | peak RSS (MB) |",
        "|---|---|---|---|---|",
    ]
    for e in args.engines:
        m = med[e]
        lines.append(
            f"| {e} | {m['decode_tok_s']:.1f} | {m['ttft_s']:.2f} | {m['streams_tok_s']:.1f} | {m['peak_rss_mb']:.0f} |"
        )
    if "llamacpp" in med and "ours" in med:
        a, b = med["ours"], med["llamacpp"]
        lines += [
            "",
            f"ours / llama.cpp (Q4_1): decode {a['decode_tok_s'] / b['decode_tok_s']:.2f}x, "
            f"{args.streams} streams {a['streams_tok_s'] / b['streams_tok_s']:.2f}x, "
            f"TTFT {a['ttft_s'] / b['ttft_s']:.2f}x",
        ]
        if "llamacpp-q4_0" in med:
            c = med["llamacpp-q4_0"]
            lines.append(
                f"ours / llama.cpp (Q4_0 re-quantization): decode {a['decode_tok_s'] / c['decode_tok_s']:.2f}x"
                + (
                    f", ours-q4_0 {med['ours-q4_0']['decode_tok_s'] / c['decode_tok_s']:.2f}x"
                    if "ours-q4_0" in med
                    else ""
                )
            )
    lines += [
        "",
        f"Greedy agreement of the default ({agree['default_quantization']}) with fp32, first "
        f"{args.agree_tokens} tokens of {len(QUESTIONS)} prompts: {agree['agreement']:.1%} "
        f"(agreeing prefix per prompt: {agree['agreeing_prefix_per_prompt']})",
    ]
    md = "\n".join(lines) + "\n"
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"cpu_bench-{datetime.now(UTC).strftime('%Y-%m-%dT%H%M')}-{result['commit']}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(md)


if __name__ == "__main__":
    main()
