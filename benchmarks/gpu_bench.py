"""GPU benchmark: our engine and its peer side by side on one device, in one run.

Parts (all by default; `--part` picks some):
  bandwidth   device-to-device copy (bytes read + written) and a bf16 matmul: the two ceilings
  throughput  offline, the nano-vllm workload (256 requests, prompt and output lengths uniform in
              [100, 1024], seed 0, random ids < 10000, ignore_eos, temperature 0.6) on
              dummy:llama-3.2-1b and dummy:qwen2.5-0.5b in bf16, against its roofline floor
  peer        Hugging Face transformers continuous batching on the same shapes and requests (the
              first --peer-requests of them; our engine is timed on the same subset too)
  decode      decode step time at batch 1, 64, 256 with 1k context: engine step, runner, graph
              replay, against (weight bytes + KV bytes read) / measured bandwidth
  kernel      the decode attention kernel alone (Llama-3.2-1B layer: 32 q / 8 kv heads, head_dim
              64, page 16): bytes/s vs measured bandwidth, paged vs contiguous SDPA on the same data,
              and kernels that only read the same bytes (paged and flat: benchmarks/read_floor.py)
  profile     torch.profiler breakdown of the first prefill step and of eager decode steps (batch 256, 1k
              context; --profile-batches), of the default engine and each --variant
The decode kernel's launch-parameter and split sweeps are benchmarks/sweep_bench.py.
Saves JSON + a markdown table (device, commit, versions) under --out and prints the table last.

    python benchmarks/gpu_bench.py [--quick] [--part throughput decode ...] [--out DIR]
    CHATENGINE_COMMIT=$(git rev-parse --short HEAD) python benchmarks/gpu_bench.py   # .git may not travel
"""

import argparse
import functools
import gc
import json
import math
import platform
import random
import statistics
import sys
import time
import traceback
import types
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.common import commit  # noqa: E402
from benchmarks.read_floor import read_floors  # noqa: E402
from chatengine import LLM, SamplingParams  # noqa: E402
from chatengine.engine.loader import DUMMY_SHAPES  # noqa: E402
from chatengine.kernels import paged_attention as pa  # noqa: E402

MODELS = ["llama-3.2-1b", "qwen2.5-0.5b"]
SHAPES = [*MODELS, "qwen3-0.6b", "llama-3.1-8b", "gemma-3-4b"]  # --models may pick any of these
PARTS = ["bandwidth", "throughput", "peer", "decode", "kernel", "profile"]


# ---------------------------------------------------------------------------- helpers
def event_times(fn, iters: int, warmup: int = 3) -> list[float]:
    """ms per call of fn, timed with CUDA events one call at a time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return times


def graph_time(fn, iters: int = 20) -> float:
    """Median ms of one replay of a CUDA graph of fn (launch gaps as inside the engine's graphs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()  # compile / warm up outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return statistics.median(event_times(g.replay, iters))


def free_memory():
    gc.collect()
    torch.cuda.empty_cache()


def nano_workload(n: int = 256, seed: int = 0, max_in: int = 1024, max_out: int = 1024):
    """nano-vllm bench.py, same RNG calls: (prompt ids, output lengths)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_in))] for _ in range(n)]
    outs = [rng.randint(100, max_out) for _ in range(n)]
    return prompts, outs


def model_bytes(shape: str) -> dict:
    """Weight bytes read by one decode step (bf16, tied embeddings read once by the LM head), KV
    bytes per token, matmul params (for prefill FLOPs)."""
    c = DUMMY_SHAPES[shape]
    H, I, L, D = c["hidden_size"], c["intermediate_size"], c["num_layers"], c["head_dim"]
    per_layer = H * (c["num_heads"] + 2 * c["num_kv_heads"]) * D + c["num_heads"] * D * H + 3 * H * I + 2 * H
    embed = c["vocab_size"] * H * (1 if c["tie_word_embeddings"] else 2)
    return {
        "weight_bytes": 2 * (L * per_layer + embed + H),
        "kv_bytes_per_token": 2 * L * c["num_kv_heads"] * D * 2,
        "matmul_params": L * per_layer,
        "vocab": c["vocab_size"],
        "layers": L,
        "q_heads": c["num_heads"],
        "head_dim": D,
    }


def log(msg: str) -> None:
    print(msg, flush=True)


def model_modes(args):
    """(model, label suffix, fused): one mode now that llama.py calls the backend's fused ops (the
    earlier `--fused` what-if patched them in; its numbers are in benchmarks/NOTES.md)."""
    for shape in args.models:
        yield shape, "", True


# ---------------------------------------------------------------------------- parts
def part_bandwidth(args, res):
    n = (1 << 30) if not args.quick else (1 << 29)  # bf16 elements: 2 GiB (1 GiB quick)
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    ms = statistics.median(event_times(functools.partial(y.copy_, x), 10))
    bw = 2 * x.numel() * 2 / (ms / 1e3)
    x = y = None
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    mm = statistics.median(event_times(functools.partial(torch.matmul, a, b), 10))
    a = b = None
    free_memory()
    res["bandwidth"] = {"copy_bytes_per_s": bw, "copy_ms": ms, "bf16_matmul_flops_per_s": 2 * 8192**3 / (mm / 1e3)}
    log(
        f"[bandwidth] D2D copy {bw / 1e12:.2f} TB/s (read+write), bf16 matmul "
        f"{res['bandwidth']['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s"
    )


def engine(shape: str, args, **kw) -> LLM:
    cfg = dict(
        device="cuda",
        dtype="bfloat16",
        max_num_seqs=256,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
        register_personas=False,
        gpu_memory_utilization=0.85,
    )
    return LLM(f"dummy:{shape}", **{**cfg, **kw})


def workload_floor(shape: str, prompts, outs, bw: float, flops: float) -> dict:
    """Roofline floor of the offline workload: every decode step reads the weights
    once and each sequence's KV once; prefill at the measured matmul rate; fp32 logits written + read."""
    m = model_bytes(shape)
    kv_reads = sum(len(p) * o + o * (o - 1) // 2 for p, o in zip(prompts, outs))  # token-reads
    steps = max(outs)
    prompt_tokens = sum(map(len, prompts))
    t_kv = kv_reads * m["kv_bytes_per_token"] / bw
    t_w = steps * m["weight_bytes"] / bw
    t_logits = sum(outs) * m["vocab"] * 4 * 2 / bw
    t_prefill = 2 * m["matmul_params"] * prompt_tokens / flops
    floor = t_kv + t_w + t_logits + t_prefill
    return {
        "floor_s": floor,
        "kv_s": t_kv,
        "weights_s": t_w,
        "logits_s": t_logits,
        "prefill_s": t_prefill,
        "ceiling_tok_s": sum(outs) / floor,
    }


class StepTimer:
    """Wraps a runner's launch and collect to split engine time into host work and runner time
    (launch: staging + queueing the forward; collect: waiting for the tokens)."""

    def __init__(self, llm):
        self.runner = llm.engine.runner
        self.real = {name: getattr(self.runner, name) for name in ("launch", "collect")}
        self.runner_s, self.steps, self.graph_steps0 = 0.0, 0, self.runner.num_graph_steps

        def timed(name):
            real = self.real[name]

            def call(*args):
                t = time.perf_counter()
                out = real(*args)
                self.runner_s += time.perf_counter() - t
                self.steps += name == "launch"
                return out

            return call

        for name in self.real:
            setattr(self.runner, name, timed(name))

    def close(self):
        for name, real in self.real.items():
            setattr(self.runner, name, real)
        return {
            "runner_s": self.runner_s,
            "steps": self.steps,
            "graph_steps": self.runner.num_graph_steps - self.graph_steps0,
        }


def run_ours(llm, prompts, outs, temperature=0.6, seeded=False):
    """One pass of the workload; `seeded`: each request with its own seed (SamplingParams.seed)."""
    params = [
        SamplingParams(temperature=temperature, ignore_eos=True, max_tokens=o, seed=i if seeded else None)
        for i, o in enumerate(outs)
    ]
    timer = StepTimer(llm)
    t = time.perf_counter()
    results = llm.generate(prompts, params)
    dt = time.perf_counter() - t
    info = timer.close()
    n_out = sum(len(r.outputs[0].token_ids) for r in results)
    assert n_out == sum(outs), (n_out, sum(outs))
    return {
        "seconds": dt,
        "output_tokens": n_out,
        "tok_s": n_out / dt,
        **info,
        "host_outside_runner_s": dt - info["runner_s"],
    }


def part_throughput(args, res):
    prompts, outs = nano_workload(args.num_requests)
    bwd = res.get("bandwidth", {})
    out = res.setdefault("throughput", {})
    for shape, suffix, fused in model_modes(args):
        llm = engine(shape, args)
        llm.generate([list(range(1, 200))] * 8, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True))
        row = run_ours(llm, prompts, outs)
        row.update(
            requests=len(prompts),
            prompt_tokens=sum(map(len, prompts)),
            stats=llm.stats(),
            kv_blocks=llm.stats()["kv_blocks_total"],
            graphs=len(llm.engine.runner.graphs),
        )
        if bwd:
            row["roofline"] = workload_floor(
                shape, prompts, outs, bwd["copy_bytes_per_s"], bwd["bf16_matmul_flops_per_s"]
            )
            row["fraction_of_ceiling"] = row["tok_s"] / row["roofline"]["ceiling_tok_s"]
        if args.seeded:  # every request seeded, then unseeded again: seeded / the two unseeded runs' mean
            row["seeded"] = run_ours(llm, prompts, outs, seeded=True)
            row["unseeded_again"] = run_ours(llm, prompts, outs)
            row["seeded_ratio"] = row["seeded"]["tok_s"] / ((row["tok_s"] + row["unseeded_again"]["tok_s"]) / 2)
            log(f"[throughput] {shape}{suffix} seeded: {row['seeded']['tok_s']:.0f} tok/s, x{row['seeded_ratio']:.3f}")
        if "peer" in args.part:  # the same subset the peer runs, for a like-for-like ratio
            k = args.peer_requests
            row["subset"] = run_ours(llm, prompts[:k], outs[:k]) | {"requests": k}
        out[shape + suffix] = row
        log(
            f"[throughput] {shape}{suffix}: {row['tok_s']:.0f} tok/s ({row['output_tokens']} tokens in "
            f"{row['seconds']:.2f} s; runner {row['runner_s']:.2f} s over {row['steps']} steps, "
            f"{row['graph_steps']} graph replays)"
            + (
                f", {100 * row['fraction_of_ceiling']:.0f}% of the {row['roofline']['ceiling_tok_s']:.0f} tok/s ceiling"
                if bwd
                else ""
            )
        )
        del llm
        free_memory()
        for variant in args.variant:  # the same workload under other engine settings
            llm = engine(shape, args, **json.loads(variant))
            llm.generate([list(range(1, 200))] * 8, SamplingParams(temperature=0.6, max_tokens=32, ignore_eos=True))
            v = run_ours(llm, prompts, outs)
            row.setdefault("variants", {})[variant] = v
            log(
                f"[throughput] {shape}{suffix} {variant}: {v['tok_s']:.0f} tok/s (runner {v['runner_s']:.2f} s of "
                f"{v['seconds']:.2f} s)"
            )
            del llm
            free_memory()


def hf_model(shape: str):
    import transformers

    c = DUMMY_SHAPES[shape]
    extra: dict = {}
    if shape.startswith("llama"):
        cls = transformers.LlamaConfig
    elif c.get("sandwich_norms"):  # Gemma 3: its sliding layers, window and query scale
        cls = transformers.Gemma3TextConfig
        windows = c["layer_windows"]
        extra = dict(
            sliding_window=max(windows),
            layer_types=["sliding_attention" if w else "full_attention" for w in windows],
            query_pre_attn_scalar=round(c["query_scale"] ** -2),
        )
    else:
        cls = transformers.Qwen3Config if c.get("qk_norm") else transformers.Qwen2Config
    cfg = cls(
        **extra,
        vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"],
        intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"],
        num_key_value_heads=c["num_kv_heads"],
        head_dim=c["head_dim"],
        rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"],
        tie_word_embeddings=c["tie_word_embeddings"],
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    errors = []
    for attn in ("paged|sdpa", "sdpa"):
        try:
            with torch.device("cuda"):
                model = transformers.AutoModelForCausalLM.from_config(
                    cfg, dtype=torch.bfloat16, attn_implementation=attn
                )
            return model.eval(), attn
        except Exception as e:  # the name changed inside 5.x
            errors.append(f"{attn}: {e}")
    raise RuntimeError("; ".join(errors))


def cb_manager(model, generation_config, kw):
    """transformers' continuous-batching manager as a context (5.x has had both spellings)."""
    import contextlib

    if hasattr(model, "continuous_batching_context_manager"):
        return model.continuous_batching_context_manager(generation_config=generation_config, **kw)

    @contextlib.contextmanager
    def manager():
        mgr = model.init_continuous_batching(generation_config=generation_config, **kw)
        mgr.start()
        try:
            yield mgr
        finally:
            mgr.stop(block=True)

    return manager()


def part_peer(args, res):
    import inspect

    import transformers
    from transformers import GenerationConfig

    prompts, outs = nano_workload(args.num_requests)
    k = args.peer_requests
    prompts, outs = prompts[:k], outs[:k]
    out = res.setdefault("peer", {})
    for shape in args.models:
        model, attn = hf_model(shape)
        gc_ = GenerationConfig(
            do_sample=True,
            temperature=0.6,
            top_k=0,
            top_p=1.0,
            max_new_tokens=max(outs),
            eos_token_id=None,
            pad_token_id=0,
        )
        kw = {}
        if hasattr(transformers.generation, "ContinuousBatchingConfig"):
            cbc = transformers.generation.ContinuousBatchingConfig
            fields = inspect.signature(cbc).parameters
            want = dict(max_memory_percent=0.8)
            if args.peer_graphs:  # the peer at its best: CUDA graphs and async batching on, if present
                want.update(use_cuda_graph=True, use_async_batching=True)
            kw["continuous_batching_config"] = cbc(**{k_: v for k_, v in want.items() if k_ in fields})
        done, tokens = {}, 0
        out.setdefault("api", {})["add_request"] = str(
            inspect.signature(transformers.generation.continuous_batching.ContinuousBatchingManager.add_request)
        )
        with cb_manager(model, gc_, kw) as mgr:
            t = time.perf_counter()
            for i, (ids, n) in enumerate(zip(prompts, outs)):
                mgr.add_request(input_ids=ids, request_id=f"r{i}", max_new_tokens=n)
            while len(done) < len(prompts) and time.perf_counter() - t < args.peer_timeout:
                r = mgr.get_result(timeout=1)
                if r is not None and r.is_finished():
                    done[r.request_id] = r
                    tokens += len(r.generated_tokens)
            dt = time.perf_counter() - t
            impl = getattr(model.config, "_attn_implementation", attn)
            cb = getattr(mgr, "continuous_batching_config", None)
        expected = sum(outs[int(rid[1:])] for rid in done)
        out[shape] = {
            "requests": len(prompts),
            "finished": len(done),
            "output_tokens": tokens,
            "expected_tokens": expected,
            "seconds": dt,
            "tok_s": tokens / dt,
            "attn_implementation": impl,
            "transformers": transformers.__version__,
            "cb_config": repr(cb)[:600] if cb is not None else None,
        }
        log(
            f"[peer] {shape}: HF CB {tokens / dt:.0f} tok/s ({len(done)}/{len(prompts)} requests, {tokens} tokens "
            f"(expected {expected}) in {dt:.1f} s, attention {impl})"
        )
        del model
        free_memory()


def part_decode(args, res):
    out = res.setdefault("decode", {})
    bw = res.get("bandwidth", {}).get("copy_bytes_per_s")
    ctx = 1024
    for shape, suffix, fused in model_modes(args):
        llm = engine(shape, args)
        eng = llm.engine
        runner = eng.runner
        m = model_bytes(shape)
        rows = out.setdefault(shape + suffix, [])
        for B in args.decode_batches:
            rng = random.Random(B)
            greedy = SamplingParams(temperature=0, max_tokens=2048, ignore_eos=True)
            ids = [eng.add_request([rng.randint(0, 10000) for _ in range(ctx)], greedy) for _ in range(B)]
            while any(not eng.requests[r].seqs[0].num_output_tokens for r in ids):
                eng.step()
            seqs = list(eng.scheduler.running)
            by_mode = {}  # the engine's step, async scheduling on and off
            for mode in (not eng.async_scheduling, eng.async_scheduling):  # the engine's own last
                eng.async_scheduling = mode
                eng.step()
                by_mode[mode] = []
                for _ in range(args.decode_steps):
                    t = time.perf_counter()
                    eng.step()
                    by_mode[mode].append(1e3 * (time.perf_counter() - t))
            steps = by_mode[eng.async_scheduling]
            host_profile = None
            if B == max(args.decode_batches):  # where the engine's host time goes
                import cProfile
                import pstats

                pr = cProfile.Profile()
                pr.enable()
                for _ in range(10):
                    eng.step()
                pr.disable()
                st = pstats.Stats(pr)
                host_profile = sorted(
                    (
                        [f"{Path(k[0]).name}:{k[1]}({k[2]})", v[2] / 10 * 1e3, v[3] / 10 * 1e3]
                        for k, v in st.stats.items()
                    ),
                    key=lambda x: -x[1],
                )[:20]
                for name, tot, cum in host_profile[:12]:
                    log(f"    host {tot:7.3f} ms self {cum:7.3f} ms cumulative per step  {name}")
            # the runner alone: recompute each sequence's newest cached token (its slot is allocated;
            # the engine allocates the next one only at the next schedule), rewriting the same values
            again = [
                types.SimpleNamespace(
                    seq_id=s.seq_id,
                    num_computed_tokens=s.num_computed_tokens - 1,
                    token_ids=s.token_ids,
                    num_tokens=s.num_computed_tokens,
                    block_table=s.block_table,
                    params=s.params,
                    generator=None,
                )
                for s in seqs
            ]
            ones = [1] * len(seqs)
            run_ms = []
            for _ in range(args.decode_steps):
                t = time.perf_counter()
                runner.run(again, ones)
                run_ms.append(1e3 * (time.perf_counter() - t))
            seqs = again
            replay = stage = None
            bs = next((b for b in sorted(runner.graphs) if b >= B), None)
            if bs is not None:
                replay = statistics.median(event_times(runner.graphs[bs][0].replay, args.decode_steps))
                t = time.perf_counter()
                for _ in range(args.decode_steps):  # host: staging the decode batch
                    runner._stage(seqs, ones, pad_to=bs)
                stage = 1e3 * (time.perf_counter() - t) / args.decode_steps
            mean_ctx = statistics.mean(s.num_tokens for s in seqs)
            floor_bytes = m["weight_bytes"] + B * mean_ctx * m["kv_bytes_per_token"] + B * m["vocab"] * 4 * 2
            row = {
                "batch": B,
                "context": mean_ctx,
                "engine_step_ms": statistics.median(steps),
                "async_scheduling": eng.async_scheduling,
                "engine_step_async_ms": statistics.median(by_mode[True]),
                "engine_step_sync_ms": statistics.median(by_mode[False]),
                "runner_ms": statistics.median(run_ms),
                "graph_replay_ms": replay,
                "graph_bs": bs,
                "stage_ms": stage,
                "host_profile_ms_per_step": host_profile,
                "floor_bytes": floor_bytes,
            }
            if bw:
                row["floor_ms"] = 1e3 * floor_bytes / bw
                row["step_over_floor"] = row["engine_step_ms"] / row["floor_ms"]
                if replay:
                    row["replay_over_floor"] = replay / row["floor_ms"]
            rows.append(row)
            log(
                f"[decode] {shape}{suffix} B={B}: step {row['engine_step_ms']:.3f} ms "
                f"(async {row['engine_step_async_ms']:.3f}, "
                f"sync {row['engine_step_sync_ms']:.3f}), runner {row['runner_ms']:.3f}, "
                f"graph {replay if replay is None else round(replay, 3)} ms, floor "
                f"{row.get('floor_ms', float('nan')):.3f} ms"
            )
            for r in ids:
                eng.abort(r)
        del llm, eng, runner
        free_memory()


def kv_setup(B: int, ctx: int, H_q: int, H_kv: int, D: int, page: int, copies: int):
    """A page-first cache holding `copies` layers of B sequences of ctx tokens on shuffled pages,
    and the same K/V gathered contiguous (B, H_kv, ctx, D) per layer, for SDPA."""
    pages = B * -(-ctx // page)
    cache = torch.randn(pages, copies, 2, page, H_kv, D, device="cuda", dtype=torch.bfloat16)
    perm = torch.randperm(pages, device="cuda").to(torch.int32)
    tables = perm.view(B, -1)
    tables = torch.cat([tables, torch.full((B, 1), -1, dtype=torch.int32, device="cuda")], 1)
    q = torch.randn(B, H_q, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.arange(B + 1, dtype=torch.int32, device="cuda")
    lens = torch.full((B,), ctx, dtype=torch.int32, device="cuda")
    return cache, tables, q, cu, lens


def contiguous_kv(cache, tables, layer, B, ctx):
    pages = tables[:, :-1].long().reshape(-1)
    k = cache[:, layer, 0].index_select(0, pages).reshape(B, -1, *cache.shape[-2:])[:, :ctx]
    v = cache[:, layer, 1].index_select(0, pages).reshape(B, -1, *cache.shape[-2:])[:, :ctx]
    return k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # (B, H_kv, ctx, D)


def attention_bench(
    B, ctx, H_q=32, H_kv=8, D=64, page=16, sdpa=True, configs=(None,), splits=(None,), variants=None, floors=False
):
    """The decode kernel on B sequences of ctx tokens, per variant: a dict of `paged_attention_triton`
    overrides (num_splits, launch, pdl; {} = the defaults), or configs x splits. Each variant is timed
    as a CUDA graph over `copies` layers (> 4x L2), then its output after those replays (the last
    layer's) is checked against SDPA on the same keys (PDL's waits included). `floors`: also time
    kernels that only read the same bytes (benchmarks/read_floor.py)."""
    kv_bytes = B * ctx * H_kv * D * 2 * 2
    copies = max(2, min(16, math.ceil(4 * 100e6 / kv_bytes)))  # > 4x L2 over the copies
    cache, tables, q, cu, lens = kv_setup(B, ctx, H_q, H_kv, D, page, copies)
    out = torch.empty_like(q)
    scale = D**-0.5
    q4 = q[:, :, None, :]  # (B, H_q, 1, D)
    k_last, v_last = contiguous_kv(cache, tables, copies - 1, B, ctx)
    ref = torch.nn.functional.scaled_dot_product_attention(q4, k_last, v_last, scale=scale, enable_gqa=True)[:, :, 0]
    k_last = v_last = None
    sms = pa.num_sms(q.device)
    if variants is None:
        variants = [{"launch": cfg, "num_splits": ns} for cfg in configs for ns in splits]
    rows = []
    for var in variants:
        var = {k: v for k, v in var.items() if v is not None}

        def paged():
            for layer in range(copies):
                pa.paged_attention_triton(
                    q,
                    cache[:, layer, 0],
                    cache[:, layer, 1],
                    cu,
                    lens,
                    tables,
                    scale,
                    max_seqlen_q=1,
                    max_seqlen_k=ctx,
                    out=out,
                    **var,
                )

        used = var.get("num_splits") or pa._decode_splits(B * H_kv, ctx, sms, D)
        rule_launch, rule_pdl = pa._decode_launch(B * H_kv, used, ctx, D, sms)  # D: a power of two here
        launch, pdl = var.get("launch") or rule_launch, var["pdl"] if "pdl" in var else rule_pdl
        row = {"launch": launch, "num_splits": used, "pdl": pdl, "default": not var}
        try:
            out.fill_(float("nan"))
            ms = graph_time(paged) / copies
            row.update(
                paged_ms=ms,
                paged_bytes_per_s=kv_bytes / (ms / 1e3),
                max_abs_diff_vs_sdpa=(out.float() - ref.float()).abs().max().item(),
            )
        except Exception as e:  # e.g. out of shared memory for a sweep point
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows.append(row)
    result = {"batch": B, "context": ctx, "kv_bytes": kv_bytes, "copies": copies, "rows": rows}
    if floors:
        result["read_floors"] = read_floors(cache, tables, lens, ctx, graph_time)
    if sdpa:
        kvs = [contiguous_kv(cache, tables, layer, B, ctx) for layer in range(copies)]

        def dense():
            for k, v in kvs:
                torch.nn.functional.scaled_dot_product_attention(q4, k, v, scale=scale, enable_gqa=True)

        ms = graph_time(dense) / copies
        result["sdpa_ms"], result["sdpa_bytes_per_s"] = ms, kv_bytes / (ms / 1e3)
        result["max_abs_diff_vs_sdpa"] = rows[0].get("max_abs_diff_vs_sdpa", float("nan"))
        kvs = None
    cache = None
    free_memory()
    return result


def variant_name(row) -> str:
    pdl = {True: " pdl", "merge": " pdl-merge"}.get(row["pdl"], "")
    return f"x{row['num_splits']} {tuple(row['launch'])}{pdl}" + (" (default)" if row.get("default") else "")


KERNEL_SHAPES = [(1, 8192), (1, 32768), (16, 4096), (64, 1024), (256, 1024), (64, 4096), (256, 4096)]


def part_kernel(args, res):
    bw = res.get("bandwidth", {}).get("copy_bytes_per_s")
    shapes = [(1, 8192), (64, 1024), (256, 1024), (256, 4096)] if args.quick else KERNEL_SHAPES
    out = res.setdefault("kernel", [])
    for B, ctx in shapes:
        r = attention_bench(B, ctx, floors=True)
        best = r["rows"][0]
        r["paged_fraction_of_bw"] = best["paged_bytes_per_s"] / bw if bw else None
        r["sdpa_fraction_of_bw"] = r["sdpa_bytes_per_s"] / bw if bw else None
        floors = r["read_floors"]
        r["paged_read_fraction_of_bw"] = r["kv_bytes"] / (paged_read_ms(r) / 1e3) / bw if bw else None
        r["contiguous_read_fraction_of_bw"] = r["kv_bytes"] / (floors["contiguous_read_ms"] / 1e3) / bw if bw else None
        out.append(r)
        log(
            f"[kernel] {B}x{ctx}: paged {best['paged_ms'] * 1e3:.1f} us = {best['paged_bytes_per_s'] / 1e12:.2f} TB/s "
            f"({variant_name(best)}), SDPA contiguous {r['sdpa_ms'] * 1e3:.1f} us = "
            f"{r['sdpa_bytes_per_s'] / 1e12:.2f} TB/s, max |diff| {r['max_abs_diff_vs_sdpa']:.2e}; reading the same "
            f"bytes only: paged {paged_read_ms(r) * 1e3:.1f} us, contiguous {floors['contiguous_read_ms'] * 1e3:.1f} us"
        )


def paged_read_ms(r) -> float:
    """The faster of the memory-only paged reads (with and without programmatic dependent launch)."""
    f = r["read_floors"]
    return min(f["paged_read_ms"], f.get("paged_read_pdl_ms", float("inf")))


def part_profile(args, res):
    for variant in [None, *args.variant]:  # the default engine, then each --variant's
        for B in args.profile_batches:
            suffix = ("" if B == 256 else f" B={B}") + (f" {variant}" if variant else "")
            profile_eager_decode(args, res, suffix, B, json.loads(variant) if variant else {})


def profile_eager_decode(args, res, suffix, B=256, options=None):
    """Kernel time of eager steps: the first prefill step (as many 1024-token prompts as its token
    budget takes), then decode steps of B sequences at 1024 tokens of context."""
    shape = args.models[0]
    llm = engine(shape, args, **{**(options or {}), "enforce_eager": True})
    eng = llm.engine
    ctx = 1024
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    ids = [eng.add_request([rng.randint(0, 10000) for _ in range(ctx)], greedy) for _ in range(B)]
    prefill = kernel_times(eng, 1)
    while any(not eng.requests[r].seqs[0].num_output_tokens for r in ids):
        eng.step()
    for _ in range(3):
        eng.step()
    decode = kernel_times(eng, 3)
    res.setdefault("profile", {})[shape + suffix] = {"batch": B, "context": ctx, **decode, "prefill_step": prefill}
    for name, r in (("prefill step", prefill), (f"decode B={B}", decode)):
        log(
            f"[profile] {shape}{suffix} eager {name}: {r['kernel_us_per_step']:.0f} us of kernels per step, "
            f"{r['num_kernel_launches_per_step']:.0f} launches"
        )
        for row in r["top"][:15]:
            log(f"    {row['us_per_step']:8.1f} us  x{row['calls_per_step']:5.0f}  {row['kernel'][:100]}")
    for r in ids:
        eng.abort(r)
    del llm, eng
    free_memory()


def kernel_times(eng, steps: int) -> dict:
    """The device time of each kernel over `steps` engine steps, per step, largest first."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t and e.device_type.name == "CUDA":
            kernels[e.key] = {"us_per_step": t / steps, "calls_per_step": e.count / steps}
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_step"])
    return {
        "kernel_us_per_step": sum(v["us_per_step"] for v in kernels.values()),
        "top": [{"kernel": k[:120], **v} for k, v in top[:25]],
        "num_kernel_launches_per_step": sum(v["calls_per_step"] for v in kernels.values()),
    }


# ---------------------------------------------------------------------------- report
def markdown(meta, res) -> str:
    L = [
        f"# GPU benchmark — {meta['device']}",
        "",
        f"commit `{meta['commit']}`, {meta['date']}, torch {meta['versions']['torch']}, triton "
        f"{meta['versions']['triton']}, transformers {meta['versions']['transformers']}, CUDA "
        f"{meta['versions']['cuda']}{', QUICK' if meta['quick'] else ''}",
        "",
    ]
    bwd = res.get("bandwidth")
    if bwd:
        L += [
            f"Measured: D2D copy {bwd['copy_bytes_per_s'] / 1e12:.2f} TB/s (read+write), bf16 matmul "
            f"{bwd['bf16_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s.",
            "",
        ]
    if res.get("throughput"):
        L += [
            "## Offline throughput (nano-vllm workload, bf16, temperature 0.6, output tokens/s)",
            "",
            "| model | requests | ours tok/s | roofline ceiling | % of ceiling | ours on peer subset | "
            "HF CB on subset | ours / HF |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for shape, r in res["throughput"].items():
            p = res.get("peer", {}).get(shape.split("+")[0])
            sub = r.get("subset")
            ceil = r.get("roofline", {}).get("ceiling_tok_s")
            L.append(
                f"| {shape} | {r['requests']} | {r['tok_s']:.0f} | {ceil or float('nan'):.0f} | "
                f"{100 * r.get('fraction_of_ceiling', float('nan')):.0f}% | "
                + (f"{sub['tok_s']:.0f} ({sub['requests']} req)" if sub else "-")
                + " | "
                + (f"{p['tok_s']:.0f} ({p['finished']}/{p['requests']} req, {p['attn_implementation']})" if p else "-")
                + " | "
                + (f"{sub['tok_s'] / p['tok_s']:.1f}x" if p and sub and p["tok_s"] else "-")
                + " |"
            )
        L.append("")
        seeded = {k: r for k, r in res["throughput"].items() if "seeded" in r}
        if seeded:
            L += [
                "Every request seeded (`SamplingParams.seed`), same engine, between two unseeded runs:",
                "",
                "| model | unseeded tok/s (two runs) | seeded tok/s | seeded / unseeded mean |",
                "|---|---:|---:|---:|",
            ]
            for shape, r in seeded.items():
                L.append(
                    f"| {shape} | {r['tok_s']:.0f}, {r['unseeded_again']['tok_s']:.0f} | "
                    f"{r['seeded']['tok_s']:.0f} | {r['seeded_ratio']:.3f} |"
                )
            L.append("")
        varied = {k: r for k, r in res["throughput"].items() if r.get("variants")}
        if varied:
            L += [
                "The same workload under other engine settings (`--variant`), one after the other in one process:",
                "",
                "| model | variant | default tok/s | variant tok/s | variant / default |",
                "|---|---|---:|---:|---:|",
            ]
            for shape, r in varied.items():
                for name, v in r["variants"].items():
                    L.append(
                        f"| {shape} | `{name}` | {r['tok_s']:.0f} | {v['tok_s']:.0f} | {v['tok_s'] / r['tok_s']:.3f} |"
                    )
            L.append("")
    if res.get("decode"):
        L += [
            "## Decode step, 1k context (ms)",
            "",
            "| model | batch | engine step | step, sync scheduling | runner | graph replay | floor | step / floor | "
            "graph / floor |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for shape, rows in res["decode"].items():
            for r in rows:
                L.append(
                    f"| {shape} | {r['batch']} | {r['engine_step_ms']:.3f} | "
                    f"{r.get('engine_step_sync_ms', float('nan')):.3f} | {r['runner_ms']:.3f} | "
                    f"{r['graph_replay_ms'] or float('nan'):.3f} | {r.get('floor_ms', float('nan')):.3f} | "
                    f"{r.get('step_over_floor', float('nan')):.2f} | "
                    f"{r.get('replay_over_floor', float('nan')):.2f} |"
                )
        L.append("")
    if res.get("kernel"):
        L += [
            "## Decode attention kernel (Llama-3.2-1B layer, bf16, page 16)",
            "",
            "| batch x context | KV MB | paged us | paged TB/s | % of copy BW | splits | SDPA contiguous us | "
            "SDPA TB/s | read only, paged us (%) | read only, contiguous us (%) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res["kernel"]:
            b = r["rows"][0]
            floors = "| - | - |"
            if r.get("read_floors"):
                floors = (
                    f"| {paged_read_ms(r) * 1e3:.1f} ({100 * (r['paged_read_fraction_of_bw'] or float('nan')):.0f}%) "
                    f"| {r['read_floors']['contiguous_read_ms'] * 1e3:.1f} "
                    f"({100 * (r['contiguous_read_fraction_of_bw'] or float('nan')):.0f}%) |"
                )
            L.append(
                f"| {r['batch']}x{r['context']} | {r['kv_bytes'] / 1e6:.0f} | {b['paged_ms'] * 1e3:.1f} | "
                f"{b['paged_bytes_per_s'] / 1e12:.2f} | {100 * (r['paged_fraction_of_bw'] or float('nan')):.0f}% | "
                f"{b['num_splits']} | {r['sdpa_ms'] * 1e3:.1f} | {r['sdpa_bytes_per_s'] / 1e12:.2f} {floors}"
            )
        L += [
            "",
            "Read only: memory-only kernels over the same bytes (benchmarks/read_floor.py): what an attention "
            "kernel could at best approach at that size.",
            "",
        ]
    if res.get("errors"):
        L += ["## Errors", ""] + [f"- {k}: {v.splitlines()[-1][:300]}" for k, v in res["errors"].items()] + [""]
    return "\n".join(L)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--render", metavar="JSON", help="only re-render the markdown of a saved JSON (no GPU)")
    ap.add_argument("--part", nargs="+", choices=PARTS, default=None, help="parts to run (default: all)")
    ap.add_argument("--quick", action="store_true", help="smaller sizes and subsets: a smoke run in ~3 min")
    ap.add_argument("--models", nargs="+", default=MODELS, choices=SHAPES)
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--seeded", action="store_true", help="throughput: also every request seeded (and the ratio)")
    ap.add_argument("--peer-requests", type=int, default=None, help="HF CB subset (default 64, quick 16)")
    ap.add_argument("--peer-timeout", type=float, default=150.0, help="seconds before the peer is cut off")
    ap.add_argument("--peer-graphs", action="store_true", help="HF CB with use_cuda_graph and async batching")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        help="extra engine settings as JSON, e.g. '{\"deterministic\": true}' (throughput and profile parts)",
    )
    ap.add_argument("--decode-batches", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--profile-batches", type=int, nargs="+", default=[256], help="batch sizes of --part profile")
    ap.add_argument("--decode-steps", type=int, default=20)
    ap.add_argument("--commit", default=None, help="commit to record (default: $CHATENGINE_COMMIT, else git)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args(argv)
    if args.render:
        saved = json.loads(Path(args.render).read_text())
        md = markdown(saved, saved["results"])
        Path(args.render).with_suffix(".md").write_text(md + "\n")
        print(md)
        return
    if not torch.cuda.is_available():
        sys.exit("gpu_bench.py needs a CUDA GPU")
    args.part = args.part or PARTS
    if args.peer_requests is None:
        args.peer_requests = 16 if args.quick else 64
    if args.quick:
        args.num_requests = min(args.num_requests, 64)
        args.decode_steps = min(args.decode_steps, 10)
    import transformers
    import triton

    meta = {
        "benchmark": "gpu_bench",
        "device": torch.cuda.get_device_name(),
        "commit": commit(args.commit),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "quick": args.quick,
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "transformers": transformers.__version__,
            "cuda": torch.version.cuda,
            "python": platform.python_version(),
        },
        "command": "python benchmarks/gpu_bench.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    res = {"errors": {}}
    parts = ["bandwidth"] + [p for p in args.part if p != "bandwidth"]
    for part in parts:
        t = time.perf_counter()
        try:
            globals()[f"part_{part}"](args, res)
        except Exception:
            res["errors"][part] = traceback.format_exc()
            log(f"[{part}] FAILED\n{res['errors'][part]}")
        free_memory()
        log(f"[{part}] {time.perf_counter() - t:.1f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"gpu_bench-{meta['date'][:10]}-{meta['commit']}{'-quick' if args.quick else ''}"
    stem.with_suffix(".json").write_text(
        json.dumps({**meta, "args": vars(args), "results": res}, indent=1, default=str)
    )
    try:
        md = markdown(meta, res)
    except Exception:
        md = "markdown failed:\n" + traceback.format_exc() + "\n" + json.dumps(res, indent=1, default=str)[:6000]
    stem.with_suffix(".md").write_text(md + "\n")
    print("\n" + md, flush=True)
    print(f"saved {stem}.json and .md")


if __name__ == "__main__":
    main()
