"""Prefix sharing (issue #3): what shared KV pages buy, measured.

1. TTFT of a ~2k-token persona system prompt + a ~128-token question, cold (the persona is in no
   cache: a fresh persona text per trial) vs cached (the same persona again, another question and,
   with a tokenizer, another user: the persona's pages are public). One request alone, 1 output
   token; TTFT = RequestOutput.first_token_time - arrival_time; median over --trials.
   With a tokenizer (the default model) the prompts go through register_persona + chat(user=...);
   dummy weights have none, so the persona and the question are token-id lists (generate, user=None).
2. Peak KV blocks of one request with n parallel samples (n = 1, 4, 8: a 1024-token prompt, 256 new
   tokens, EOS ignored, temperature 0.8, seeded) against n independent requests (n different
   prompts), both measured by stepping the engine and reading the block manager after every step,
   and against the theoretical minimum: the prompt's full blocks once, plus per sample the blocks
   for the rest of the tokens it holds in KV (prompt + new tokens - 1: the last token is never
   computed). Every prompt there is fresh random ids, so nothing from phase 1 or an earlier run hits.

Saves JSON + markdown under benchmarks/results/ and prints the tables last.

    python benchmarks/prefix_bench.py                      # default model, CPU fp32
    python benchmarks/prefix_bench.py --model dummy:llama-3.2-1b --device cuda --dtype bfloat16
"""

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402

WORDS = (
    "the a of to and in is it you that he was for on are with as his they be at one have this from "
    "or had by word but what some we can out other were all there when up use your how said an each "
    "she which do their time if will way about many then them write would like so these her long make "
    "thing see him two has look more day could go come did number sound no most people my over know "
    "water than call first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under name very "
    "through just form sentence great think say help low line differ turn cause much mean before move "
    "right boy old too same tell does set three want air well also play small end put home read hand "
    "port large spell add even land here must big high such follow act why ask men change went light "
    "kind off need house picture try us again animal point mother world near build self earth father"
).split()


def filler(rng: random.Random, tok, num_tokens: int, head: str = "") -> str:
    """Seeded random English-looking text of about num_tokens tokens (never fewer)."""
    sentences = [head] if head else []
    while True:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        sentences.append(" ".join(words).capitalize() + ".")
        text = " ".join(sentences)
        if len(sentences) % 8 == 0 or len(text) > 3 * num_tokens:
            if len(tok.encode(text, add_special_tokens=False)) >= num_tokens:
                return text


# ---- phase 1: TTFT cold vs cached ---------------------------------------------------------------
def ttft_phase(
    llm: LLM, trials: int, persona_tokens: int, question_tokens: int, rng: random.Random, profile: bool = False
) -> dict:
    engine = llm.engine
    bs = engine.config.block_size
    tok = llm.get_tokenizer()
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    vocab = min(engine.model_config.vocab_size, 10000)

    if tok is not None:
        mode = "chat: register_persona + chat(user=...), cached by another user"

        def make_persona(i):
            text = filler(
                rng,
                tok,
                persona_tokens - 16,
                head=f"You are persona {i} of a benchmark. Stay in character and answer briefly.",
            )
            llm.register_persona(f"prefix-bench-{i}-{rng.randrange(1 << 30)}", text)
            return text, len(engine.persona_prefix_ids(text))

        def ask(persona, user):
            q = filler(rng, tok, question_tokens - 8, head="Here is my question, please read it all.") + " Why?"
            return llm.chat([{"role": "system", "content": persona}, {"role": "user", "content": q}], one, user=user)[0]
    else:
        mode = "token ids: generate(persona + question ids, user=None) (no tokenizer)"

        def make_persona(i):
            ids = [rng.randrange(vocab) for _ in range(persona_tokens)]
            return ids, len(ids)

        def ask(persona, user):
            return llm.generate([persona + [rng.randrange(vocab) for _ in range(question_tokens)]], one)[0]

    def timed(persona, user):
        t, c = time.perf_counter(), time.process_time()
        out = ask(persona, user)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        return out, out.first_token_time - out.arrival_time, wall, cpu

    # warm-up: one cold and one cached request of the same shape (kernels, allocator, graphs)
    persona, _ = make_persona("warmup")
    timed(persona, "warmup-a"), timed(persona, "warmup-b")

    rows = []
    for i in range(trials):
        persona, prefix_len = make_persona(i)
        cold, cold_s, cold_wall, cold_cpu = timed(persona, f"cold-user-{i}")
        hot, hot_s, hot_wall, hot_cpu = timed(persona, f"other-user-{i}")
        expected = prefix_len // bs * bs  # the persona's full blocks
        rows.append(
            {
                "trial": i,
                "persona_tokens": prefix_len,
                "prompt_tokens_cold": len(cold.prompt_token_ids),
                "prompt_tokens_cached": len(hot.prompt_token_ids),
                "cold_ttft_ms": 1e3 * cold_s,
                "cached_ttft_ms": 1e3 * hot_s,
                "cold_wall_ms": 1e3 * cold_wall,
                "cached_wall_ms": 1e3 * hot_wall,
                "cold_cpu_ms": 1e3 * cold_cpu,
                "cached_cpu_ms": 1e3 * hot_cpu,
                "cold_cached_tokens": cold.num_cached_tokens,
                "cached_cached_tokens": hot.num_cached_tokens,
                "expected_cached_tokens": expected,
            }
        )
        print(
            f"ttft trial {i}: cold {1e3 * cold_s:8.1f} ms ({cold.num_cached_tokens} cached) | "
            f"cached {1e3 * hot_s:8.1f} ms ({hot.num_cached_tokens}/{expected} cached)",
            flush=True,
        )
        if cold.num_cached_tokens > bs:
            print(f"  WARNING: the cold request hit {cold.num_cached_tokens} cached tokens", flush=True)
        if hot.num_cached_tokens < expected:
            print(
                f"  WARNING: the cached request hit only {hot.num_cached_tokens} of the persona's {expected}",
                flush=True,
            )

    if profile:  # where a cached request's TTFT goes
        import cProfile
        import pstats

        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        persona, _ = make_persona("profile")
        timed(persona, "profile-a")
        pr = cProfile.Profile()
        pr.enable()
        timed(persona, "profile-b")
        pr.disable()
        pstats.Stats(pr).sort_stats("cumulative").print_stats(30)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with torch_profile(activities=acts) as prof:
            timed(persona, "profile-c")
        sort = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=20))

    def med(key):
        return statistics.median(r[key] for r in rows)

    summary = {
        "mode": mode,
        "trials": trials,
        "persona_tokens": med("persona_tokens"),
        "question_tokens": med("prompt_tokens_cached") - med("persona_tokens"),
        "prompt_tokens": med("prompt_tokens_cold"),
        "cold_ttft_ms": med("cold_ttft_ms"),
        "cached_ttft_ms": med("cached_ttft_ms"),
        "cold_wall_ms": med("cold_wall_ms"),
        "cached_wall_ms": med("cached_wall_ms"),
        "cold_cpu_ms": med("cold_cpu_ms"),
        "cached_cpu_ms": med("cached_cpu_ms"),
        "cold_cached_tokens_max": max(r["cold_cached_tokens"] for r in rows),
        "cached_cached_tokens_min": min(r["cached_cached_tokens"] for r in rows),
        "expected_cached_tokens_min": min(r["expected_cached_tokens"] for r in rows),
        "max_num_batched_tokens": engine.config.max_num_batched_tokens,
    }
    summary["ratio"] = summary["cold_ttft_ms"] / summary["cached_ttft_ms"]
    summary["cpu_ratio"] = summary["cold_cpu_ms"] / summary["cached_cpu_ms"]
    return {"summary": summary, "trials": rows}


# ---- phase 2: peak KV blocks, n samples vs n independent requests --------------------------------
def drive(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """Run the requests to the end one step at a time; blocks in use after every step."""
    engine = llm.engine
    bm = engine.block_manager
    assert not engine.has_unfinished_requests()
    assert bm.num_blocks - bm.num_free_blocks == 0, "blocks still in use before the run"
    preempted0 = engine.scheduler.num_preemptions
    ids = [engine.add_request(p, params) for p in prompts]
    peak = peak_live = steps = 0
    final = {}
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        used = bm.num_blocks - bm.num_free_blocks  # ref_count > 0
        live = {
            b for req in engine.requests.values() for s in req.seqs if not s.is_finished for b in s.block_table
        }  # cross-check: blocks in live tables
        peak, peak_live = max(peak, used), max(peak_live, len(live))
    seconds = time.perf_counter() - t
    outs = [final[i] for i in ids]
    for o in outs:
        assert len(o.outputs) == params.n and all(len(c.token_ids) == params.max_tokens for c in o.outputs), (
            "a sample stopped early"
        )
    return {
        "peak_blocks": peak,
        "peak_blocks_in_live_tables": peak_live,
        "steps": steps,
        "seconds": seconds,
        "cached_tokens": sum(o.num_cached_tokens for o in outs),
        "preemptions": engine.scheduler.num_preemptions - preempted0,
    }


def kv_phase(llm: LLM, ns: list[int], prompt_tokens: int, new_tokens: int, seed: int) -> list[dict]:
    engine = llm.engine
    bs = engine.config.block_size
    vocab = min(engine.model_config.vocab_size, 10000)
    rng = random.Random(1_000_003 + seed)  # not phase 1's stream: no prompt repeats
    fresh = lambda: [rng.randrange(vocab) for _ in range(prompt_tokens)]  # noqa: E731
    held = prompt_tokens + new_tokens - 1  # tokens of one sample in KV at its last step
    per_sample = -(-held // bs) - prompt_tokens // bs
    rows = []
    for n in ns:
        params = SamplingParams(n=n, temperature=0.8, max_tokens=new_tokens, ignore_eos=True, seed=seed + n)
        shared = drive(llm, [fresh()], params)
        one = SamplingParams(n=1, temperature=0.8, max_tokens=new_tokens, ignore_eos=True, seed=seed + n)
        indep = shared if n == 1 else drive(llm, [fresh() for _ in range(n)], one)
        minimum = prompt_tokens // bs + n * per_sample
        row = {
            "n": n,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "block_size": bs,
            "peak_blocks": shared["peak_blocks"],
            "min_blocks": minimum,
            "over_min_pct": 100 * (shared["peak_blocks"] - minimum) / minimum,
            "independent_peak_blocks": indep["peak_blocks"],
            "independent_theory_blocks": n * -(-held // bs),
            "saved_pct": 100 * (1 - shared["peak_blocks"] / indep["peak_blocks"]),
            "min_saved_pct": 100 * (1 - minimum / (n * -(-held // bs))),
            "shared_run": shared,
            "independent_run": indep,
        }
        rows.append(row)
        print(
            f"kv n={n}: peak {row['peak_blocks']} blocks (min {minimum}, +{row['over_min_pct']:.1f}%), "
            f"independent {row['independent_peak_blocks']} -> saved {row['saved_pct']:.1f}% "
            f"[{shared['seconds']:.1f}s + {indep['seconds']:.1f}s]",
            flush=True,
        )
        if shared["cached_tokens"] or indep["cached_tokens"] or shared["preemptions"] or indep["preemptions"]:
            print("  WARNING: prefix hits or preemptions confound this row", flush=True)
    return rows


def render(meta: dict, ttft: dict, kv: list[dict]) -> list[str]:
    s = ttft["summary"]
    lines = [
        f"# Prefix sharing (issue #3) — {meta['model']} {meta['dtype']} on {meta['device']}",
        "",
        f"commit {meta['commit']}, {meta['date']}, torch {meta['torch']}, transformers {meta['transformers']}, "
        f"{meta['threads']} torch threads, load average {meta['loadavg_start']} at start, "
        f"{meta['loadavg_end']} at the end; {meta['seconds']:.0f} s in all",
        "",
        f"`{meta['command']}`",
        "",
        f"## TTFT, cold vs cached persona (median of {s['trials']}, one request alone, 1 output token)",
        "",
        f"Prompts: {s['mode']}; step token budget {s['max_num_batched_tokens']}. "
        "TTFT = first_token_time - arrival_time (engine); wall = the whole call; process CPU time of "
        "the whole call (host side only on CUDA; on a shared CPU box it is less sensitive to other load).",
        "",
        "| persona tokens | question tokens | cold TTFT ms | cached TTFT ms | cold / cached | "
        "cold / cached wall ms | cold / cached CPU-time ms (ratio) | "
        "cached tokens: cold / cached (persona full blocks) |",
        "|---:|---:|---:|---:|---:|---|---|---|",
        f"| {s['persona_tokens']:.0f} | {s['question_tokens']:.0f} | {s['cold_ttft_ms']:.1f} | "
        f"{s['cached_ttft_ms']:.1f} | **{s['ratio']:.1f}x** | {s['cold_wall_ms']:.1f} / {s['cached_wall_ms']:.1f} | "
        f"{s['cold_cpu_ms']:.0f} / {s['cached_cpu_ms']:.0f} ({s['cpu_ratio']:.1f}x) | "
        f"max {s['cold_cached_tokens_max']} / min {s['cached_cached_tokens_min']} "
        f"({s['expected_cached_tokens_min']}) |",
        "",
    ]
    k0 = kv[0]
    lines += [
        f"## Peak KV blocks, n parallel samples vs n independent requests "
        f"({k0['prompt_tokens']}-token prompt, {k0['new_tokens']} new tokens, block {k0['block_size']})",
        "",
        "Measured after every engine step: blocks with ref_count > 0. Minimum = the prompt's full blocks "
        "once + per sample the blocks for its remaining tokens in KV (prompt + new - 1). Independent = "
        "n requests with different prompts, measured.",
        "",
        "| n | peak blocks | minimum | over minimum | independent peak (theory) | saved vs independent "
        "| saved at the minimum |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['n']} | {r['peak_blocks']} | {r['min_blocks']} | {r['over_min_pct']:+.1f}% | "
        f"{r['independent_peak_blocks']} ({r['independent_theory_blocks']}) | {r['saved_pct']:.1f}% | "
        f"{r['min_saved_pct']:.1f}% |"
        for r in kv
    ]
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="None: the embedded default; a path; dummy:<shape>")
    ap.add_argument("--device", default=None, help="cpu | cuda (default: cuda when available)")
    ap.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default by device)")
    ap.add_argument("--trials", type=int, default=5, help="TTFT trials (median reported)")
    ap.add_argument("--persona-tokens", type=int, default=2048)
    ap.add_argument("--question-tokens", type=int, default=128)
    ap.add_argument("--kv-n", type=int, nargs="+", default=[1, 4, 8], help="parallel samples")
    ap.add_argument("--kv-prompt-tokens", type=int, default=1024)
    ap.add_argument("--kv-new-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: torch's). On a CPU shared with other jobs, 1 avoids "
        "OpenMP threads spinning at barriers while the other core is taken",
    )
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"), help="directory for results")
    ap.add_argument("--profile", action="store_true", help="print cProfile + torch.profiler of one cached request")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    loadavg_start = [round(x, 2) for x in os.getloadavg()]
    sha = commit()  # at the start: the tree may change while this runs
    t0 = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    st = llm.stats()
    print(
        f"loaded {st['model']} on {st['device']} {st['dtype']} ({st['attention_backend']}), "
        f"{st['kv_blocks_total']} KV blocks, {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    rng = random.Random(args.seed)
    ttft = ttft_phase(llm, args.trials, args.persona_tokens, args.question_tokens, rng, args.profile)
    kv = kv_phase(llm, args.kv_n, args.kv_prompt_tokens, args.kv_new_tokens, args.seed)

    cuda = st["device"].startswith("cuda")
    device = torch.cuda.get_device_name() if cuda else (platform.processor() or platform.machine())
    meta = {
        "benchmark": "prefix",
        "issue": 3,
        "model": st["model"],
        "dtype": st["dtype"],
        "device": device,
        "attention_backend": st["attention_backend"],
        "kv_blocks_total": st["kv_blocks_total"],
        "commit": sha,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "loadavg_start": loadavg_start,
        "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        "seconds": time.perf_counter() - t0,
        "args": vars(args),
        "command": "python benchmarks/prefix_bench.py " + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    meta["command"] = meta["command"].strip()
    lines = render(meta, ttft, kv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = meta["date"][:19].replace(":", "")
    stem = out / f"prefix_bench-{'cuda' if cuda else 'cpu'}-{stamp}-{meta['commit']}"
    stem.with_suffix(".json").write_text(json.dumps({**meta, "ttft": ttft, "kv_blocks": kv}, indent=1))
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"saved {stem}.json and .md ({meta['seconds']:.0f}s)")
    llm.shutdown()


if __name__ == "__main__":
    main()
