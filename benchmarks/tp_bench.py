"""Tensor parallelism on GPUs: logits against one GPU, throughput against one GPU, and a model too big
for one.

    python benchmarks/tp_bench.py [--part logits throughput big] [--shape llama-3.1-8b] [--tp 2]
    python benchmarks/tp_bench.py --part big --big-shape llama-3.1-70b --big-tp 4
    python benchmarks/tp_bench.py --dry-run            # prints the plan, touches no GPU

Parts (logits and throughput by default):
  logits      the last-token logits of 8 prompts (100..512 tokens) at TP=1 and TP=N, fp32, eager, on
              the same dummy weights: the largest absolute difference (the promise: <= 1e-4), with the
              torch attention reference (the same arithmetic on any number of heads), with the
              Triton kernels (their split counts follow the heads a rank holds), and (TP=2) in
              deterministic mode, whose row-parallel sums reduce the same halves on one rank and two
  throughput  the nano-vllm workload (256 requests, prompt and output lengths uniform in [100, 1024],
              seed 0, random ids < 10000, ignore_eos, temperature 0.6; benchmarks/gpu_bench.py's)
              in bf16 at TP=1 and TP=N in the same run: output tokens/s and the ratio (goal >= 1.6x);
              TP=N twice: sums through the one-shot NVLink path (the default) and through NCCL's ring alone
              (the logits part, after throughput in one process, sums through NCCL: a process's later groups
              do; alone, its first TP=N engine takes the one-shot path)
  big         the same workload on a shape one GPU cannot hold (llama-3.1-70b, 140 GB in bf16) at
              TP=--big-tp only: load time, KV pages, output tokens/s

Needs N GPUs; NVLink multicast stays off (the engine sets NCCL_NVLS_ENABLE=0 and
TORCH_SYMM_MEM_DISABLE_MULTICAST=1). Saves JSON + markdown
under --out and prints the table last.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from benchmarks.gpu_bench import nano_workload  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402
from chatengine.engine.loader import DUMMY_SHAPES  # noqa: E402
from chatengine.engine.sequence import Sequence  # noqa: E402

PARTS = ["logits", "throughput", "big", "profile"]


def engine(shape: str, tp: int, dtype: str, args, **kw) -> LLM:
    cfg = dict(
        device="cuda",
        dtype=dtype,
        tensor_parallel_size=tp,
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        register_personas=False,
        gpu_memory_utilization=0.85,
        cpu_offload_gib=0,
    )
    return LLM(f"dummy:{shape}", **{**cfg, **kw})


def release(llm: LLM) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()


def prefill_logits(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    """(len(prompts), vocab) fp32 logits of each prompt's last token, straight from the runner (every
    rank runs the same forward: rank 0 sends it)."""
    runner, bs, first, rows = llm.engine.runner, llm.engine.config.block_size, 0, []
    for p in prompts:
        seq = Sequence(p, SamplingParams(), block_size=bs)
        n = -(-len(p) // bs)
        seq.block_table, first = list(range(first, first + n)), first + n
        logits = runner._forward([seq], [len(p)], whole=True)[0]
        rows.append(logits[-1].float().cpu())
    return torch.stack(rows)


def part_logits(args, res) -> None:
    prompts = nano_workload(8, seed=1, max_in=512)[0]
    out = res["logits"] = {}
    tp1 = {}
    variants = {"torch": dict(attention_backend="torch"), "triton": dict(attention_backend="triton")}
    if args.tp == 2:  # deterministic mode runs on one or two ranks, the same answers on both
        variants["deterministic"] = dict(deterministic=True)
    for backend, kw in variants.items():
        got = {}
        for tp in (1, args.tp):
            llm = engine(args.shape, tp, "float32", args, enforce_eager=True, **kw)
            got[tp] = prefill_logits(llm, prompts)
            release(llm)
        diff = (got[1] - got[args.tp]).abs()
        out[backend] = {
            "prompts": len(prompts),
            "max_abs_diff": diff.max().item(),
            "mean_abs_diff": diff.mean().item(),
            "largest_logit": got[1].abs().max().item(),
            "same_argmax": bool((got[1].argmax(-1) == got[args.tp].argmax(-1)).all()),
        }
        print(f"[logits] {backend}: {json.dumps(out[backend])}", flush=True)
        tp1[backend] = got[1]
    # fp32's own noise: the same TP=1 forward with the attention's sums in another order
    out["torch_vs_triton_tp1"] = (tp1["torch"] - tp1["triton"]).abs().max().item()
    print(f"[logits] TP=1 torch vs triton attention: {out['torch_vs_triton_tp1']:.2e}", flush=True)


BUCKETS = ("prefill", "decode 1-32", "decode 33-64", "decode 65-128", "decode 129-256", "decode 257+")


def bucket(seqs: int, tokens: int) -> str:
    """A step's kind: any prompt chunk in it, else a decode step by its batch size."""
    if tokens > seqs:
        return "prefill"
    top = next((b for b in (32, 64, 128, 256) if seqs <= b), None)
    return next(k for k in BUCKETS if k.endswith(f"-{top}")) if top else "decode 257+"


def watch_steps(runner) -> tuple[list[float], dict[str, list[float]]]:
    """Seconds each of the runner's collects blocks on its step's tokens (appended as it runs), and
    the seconds between consecutive collects by the collected step's kind (`bucket`): with the GPU
    busy throughout, a step's share of the run, to see which steps lose most at TP=N."""
    waits: list[float] = []
    shares: dict[str, list[float]] = {k: [] for k in BUCKETS}
    kinds: dict[int, str] = {}
    launch, collect = runner.launch, runner.collect
    last = [time.perf_counter()]

    def launched(seqs, num_new_tokens, between=None):
        step = launch(seqs, num_new_tokens, between)
        kinds[id(step)] = bucket(len(seqs), sum(num_new_tokens))
        return step

    def timed(step):
        t = time.perf_counter()
        if step.done is not None:
            step.done.synchronize()
        waits.append(time.perf_counter() - t)
        out = collect(step)
        now = time.perf_counter()
        shares[kinds.pop(id(step), "prefill")].append(now - last[0])
        last[0] = now
        return out

    runner.launch, runner.collect = launched, timed
    return waits, shares


def run_workload(llm: LLM, prompts, outs) -> dict:
    llm.generate([list(range(1, 200))] * 8, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True))
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o) for o in outs]
    waits, shares = watch_steps(llm.engine.runner)
    steps0 = llm.stats()["num_steps"]
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    steps = llm.stats()["num_steps"] - steps0
    n = sum(len(r.outputs[0].token_ids) for r in results)
    assert n == sum(outs), (n, sum(outs))
    runner = llm.engine.runner
    return {
        "seconds": dt,
        "output_tokens": n,
        "tok_s": n / dt,
        "kv_blocks": llm.stats()["kv_blocks_total"],
        "decode_graphs": len(runner.graphs),
        "graph_steps": runner.num_graph_steps,
        # where a step's time goes: the engine's host work overlaps the GPU's (async scheduling); the
        # part spent blocked on the GPU's tokens is the GPU's lead, the rest is host-bound time
        "steps": steps,
        "step_ms": 1000 * dt / max(steps, 1),
        "wait_ms": 1000 * sum(waits) / max(steps, 1),
        # by the step's kind: (steps, seconds between its collect and the one before)
        "by_kind": {k: (len(v), sum(v)) for k, v in shares.items() if v},
    }


def part_throughput(args, res) -> None:
    prompts, outs = nano_workload(args.num_requests)
    out = res["throughput"] = {}
    before = os.environ.get("CHATENGINE_ALL_REDUCE")
    try:  # TP=N twice: sums through the one-shot path (the default), and through NCCL's ring alone
        for name, tp, all_reduce in (
            ("tp1", 1, "nccl"),
            (f"tp{args.tp}", args.tp, "one-shot"),
            ("nccl", args.tp, "nccl"),
        ):
            os.environ["CHATENGINE_ALL_REDUCE"] = all_reduce  # read as the ranks join (children inherit it)
            llm = engine(args.shape, tp, "bfloat16", args)
            one_shot = tp > 1 and llm.engine.ranks.group.one_shot is not None
            out[name] = {**run_workload(llm, prompts, outs), "one_shot": one_shot}
            release(llm)
            row = out[name]
            print(
                f"[throughput] {args.shape} TP={tp} ({'one-shot sums' if one_shot else 'NCCL sums'}): "
                f"{row['tok_s']:,.0f} output tok/s ({row['seconds']:.1f} s); "
                f"{row['steps']} steps of {row['step_ms']:.2f} ms, {row['wait_ms']:.2f} ms of each waiting for the GPU"
            )
    finally:
        if before is None:
            os.environ.pop("CHATENGINE_ALL_REDUCE", None)
        else:
            os.environ["CHATENGINE_ALL_REDUCE"] = before
    out["ratio"] = out[f"tp{args.tp}"]["tok_s"] / out["tp1"]["tok_s"]
    out["ratio_nccl"] = out["nccl"]["tok_s"] / out["tp1"]["tok_s"]
    ratios = f"{out['ratio']:.2f}x (NCCL sums only: {out['ratio_nccl']:.2f}x)"
    print(f"[throughput] TP={args.tp} / TP=1: {ratios}", flush=True)


def part_big(args, res) -> None:
    prompts, outs = nano_workload(args.num_requests)
    t = time.perf_counter()
    llm = engine(args.big_shape, args.big_tp, "bfloat16", args)
    load_s = time.perf_counter() - t
    row = res["big"] = {
        "shape": args.big_shape,
        "tp": args.big_tp,
        "load_s": load_s,
        **run_workload(llm, prompts, outs),
    }
    release(llm)
    print(
        f"[big] {args.big_shape} TP={args.big_tp}: loaded in {load_s:.0f} s, {row['kv_blocks']} KV pages, "
        f"{row['tok_s']:,.0f} output tok/s ({row['seconds']:.1f} s)",
        flush=True,
    )


def part_profile(args, res) -> None:
    """Eager decode steps at batch --num-requests (1k-token prompts, prefilled first) under
    torch.profiler, at TP=1 and TP=N: rank 0's GPU time per kernel, to see what does not halve."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prompts = [[(7 * i + j) % 200 + 1 for j in range(1000)] for i in range(args.num_requests)]
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=64)
    out = res["profile"] = {}
    for tp in (1, args.tp):
        llm = engine(args.shape, tp, "bfloat16", args, enforce_eager=True)
        core = llm.engine
        for p in prompts:
            core.add_request(p, params)
        while core.scheduler.waiting or any(
            s.num_computed_tokens < s.num_prompt_tokens for s in core.scheduler.running
        ):
            core.step()
        for _ in range(4):
            core.step()
        batch = len(core.scheduler.running)  # below --num-requests if the KV pool holds fewer
        torch.cuda.synchronize()
        t = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile_steps):
                core.step()
            torch.cuda.synchronize()
        n = args.profile_steps
        wall = (time.perf_counter() - t) / n
        # the GPU's own entries (kernels, copies), each once: an op's entry repeats its kernels' time
        kernels = [e for e in prof.key_averages() if e.device_type == DeviceType.CUDA]
        rows = sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]
        total = sum(e.self_device_time_total for e in kernels) / n / 1000
        out[f"tp{tp}"] = {
            "batch": batch,
            "step_ms_wall": 1000 * wall,
            "gpu_ms_per_step": total,
            "top": [(e.key[:70], e.self_device_time_total / n / 1000, e.count // n) for e in rows],
        }
        print(f"[profile] TP={tp}, batch {batch}: {1000 * wall:.2f} ms a step (eager, profiled), GPU {total:.2f} ms")
        for key, ms, calls in out[f"tp{tp}"]["top"]:
            print(f"    {ms:8.3f} ms  x{calls:<4} {key}")
        while core.has_unfinished_requests():
            core.step()
        release(llm)


def markdown(res) -> str:
    lines = [
        f"# tp_bench {res['date']} ({res['commit']})",
        "",
        f"{res['gpus']} x {res['gpu']}, torch {res['torch']}",
        "",
    ]
    if "logits" in res:
        lines += [f"| logits (fp32, TP=1 vs TP={res['tp']}) | max abs diff | mean abs diff | same argmax |"]
        lines += ["|---|---|---|---|"]
        for backend, r in res["logits"].items():
            if not isinstance(r, dict):
                continue
            name = "deterministic mode (Triton)" if backend == "deterministic" else f"{backend} attention"
            lines.append(f"| {name} | {r['max_abs_diff']:.2e} | {r['mean_abs_diff']:.2e} | {r['same_argmax']} |")
        noise = res["logits"].get("torch_vs_triton_tp1")
        if noise is not None:
            lines.append(f"\nTP=1 with torch vs Triton attention (fp32's own noise): max abs diff {noise:.2e}")
        lines.append("")
    if "throughput" in res:
        t = res["throughput"]
        lines += [
            f"| {res['shape']} bf16, nano-vllm workload | output tok/s | seconds | steps | ms a step | "
            "of it waiting for the GPU |",
            "|---|---|---|---|---|---|",
        ]
        for key in ("tp1", f"tp{res['tp']}", "nccl"):
            if key not in t:
                continue
            r = t[key]
            label = f"TP={res['tp']}, NCCL sums only" if key == "nccl" else f"TP={key[2:]}"
            lines.append(
                f"| {label} | {r['tok_s']:,.0f} | {r['seconds']:.1f} | {r['steps']} | {r['step_ms']:.2f} "
                f"| {r['wait_ms']:.2f} |"
            )
        lines += [f"| ratio | {t['ratio']:.2f}x | | | | |"]
        if "ratio_nccl" in t:
            lines += [f"| ratio, NCCL sums only | {t['ratio_nccl']:.2f}x | | | | |"]
        lines += [""]
        one, many = t["tp1"].get("by_kind", {}), t.get(f"tp{res['tp']}", {}).get("by_kind", {})
        if one and many:
            lines += [
                f"Where the time goes (seconds between collects, by the step collected): TP=1 vs TP={res['tp']}",
                "",
                f"| steps | count | TP=1 s | TP={res['tp']} s | speed-up |",
                "|---|---|---|---|---|",
            ]
            for kind in BUCKETS:
                if kind in one and kind in many:
                    (n1, s1), (_, sn) = one[kind], many[kind]
                    lines.append(f"| {kind} | {n1} | {s1:.2f} | {sn:.2f} | {s1 / max(sn, 1e-9):.2f}x |")
            lines += [""]
    for key, p in res.get("profile", {}).items():
        lines += [
            f"Eager decode steps at TP={key[2:]}, batch {p['batch']} (torch.profiler, rank 0): "
            f"{p['step_ms_wall']:.2f} ms a step, GPU {p['gpu_ms_per_step']:.2f} ms a step",
            "",
            "| GPU entry | ms a step | calls a step |",
            "|---|---|---|",
            *(f"| `{name}` | {ms:.3f} | {calls} |" for name, ms, calls in p["top"]),
            "",
        ]
    if "big" in res:
        b = res["big"]
        lines.append(
            f"{b['shape']} at TP={b['tp']}: loaded in {b['load_s']:.0f} s, {b['kv_blocks']} KV pages, "
            f"{b['tok_s']:,.0f} output tok/s on the same workload ({b['seconds']:.1f} s)"
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--part", nargs="+", choices=PARTS, default=["logits", "throughput"])
    p.add_argument("--shape", default="llama-3.1-8b", choices=sorted(DUMMY_SHAPES))
    p.add_argument("--tp", type=int, default=2, help="ranks of the parallel engine (compared with TP=1)")
    p.add_argument("--big-shape", default="llama-3.1-70b", choices=sorted(DUMMY_SHAPES))
    p.add_argument("--big-tp", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--profile-steps", type=int, default=8, help="decode steps profiled (--part profile)")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--dry-run", action="store_true", help="print what would run; touch no GPU")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    need = max(args.tp, args.big_tp if "big" in args.part else 1)
    if args.dry_run:
        print(
            f"would run {args.part} on {args.shape} (TP=1 vs TP={args.tp}); big: {args.big_shape} at TP={args.big_tp}"
        )
        print(f"needs {need} GPUs; this machine has {torch.cuda.device_count()}")
        return 0
    if torch.cuda.device_count() < need:
        sys.exit(f"error: needs {need} GPUs, this machine has {torch.cuda.device_count()}")
    res: dict = {
        "commit": commit(),
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "shape": args.shape,
        "tp": args.tp,
        "args": vars(args),
    }
    # throughput first: only a process's first tensor-parallel group can sum in one shot
    # (engine/parallel/one_shot.py), and that is the path its TP=N row measures
    for part in sorted(args.part, key=lambda p: p != "throughput"):
        {"logits": part_logits, "throughput": part_throughput, "big": part_big, "profile": part_profile}[part](
            args, res
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tp_bench-{datetime.now(UTC):%Y-%m-%dT%H%M}-{res['commit']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    text = markdown(res)
    stem.with_suffix(".md").write_text(text)
    print(text)
    print(f"saved {stem}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
