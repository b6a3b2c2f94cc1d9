"""DataParallelLLM's API process alone: how many streamed tokens a second it relays, against replicas
that run no model.

    python benchmarks/front_bench.py [--replicas 2] [--users 128] [--step-ms 2] [--seconds 12]
        [--model dummy:tiny]

With N replicas on N GPUs the one API process validates each turn, hashes it for the router, sends
it to a replica, and puts every step's deltas back into outputs for its callers. When the replicas
are fast it can be the limit of the whole (dp_bench's two replicas). Here each replica is
api_bench's stand-in (one token a running request every --step-ms, the step's deltas sent as a real
replica sends them), so the figures are the API process's: output tokens and turns a second, and
its CPU. The turns are conversation-shaped as the app sends them: --users users, each on one of 4
shared 1000-token openings, each turn the last prompt, its answer (160 tokens) and a new message of
32-255 tokens; a conversation past 1700 tokens starts again. Saves JSON under --out.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.api_bench import stand_in_replica  # noqa: E402
from benchmarks.common import save_json  # noqa: E402
from chatengine import SamplingParams  # noqa: E402

OPENING, ANSWER, RESTART = 1000, 160, 1700


async def relay(llm, users: int, seconds: float) -> dict:
    stop = time.monotonic() + seconds
    vocab = llm.front.model_config.vocab_size
    tokens, turns = [0], [0]

    async def user(i: int) -> None:
        rng = random.Random(i)

        def fresh() -> list[int]:
            return [1 + i % 4] * OPENING + [rng.randrange(vocab) for _ in range(64)]

        ids = fresh()
        while time.monotonic() < stop:
            out = None
            params = SamplingParams(max_tokens=ANSWER, ignore_eos=True)
            async for out in llm.generate(ids, params, user=f"user{i}"):
                pass
            assert out is not None and out.finished
            answer = list(out.outputs[0].token_ids)
            tokens[0] += len(answer)
            turns[0] += 1
            ids = ids + answer + [rng.randrange(vocab) for _ in range(rng.randrange(32, 256))]
            if len(ids) > RESTART:
                ids = fresh()

    t, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(user(i) for i in range(users)))
    wall = time.perf_counter() - t
    return {
        "output_tok_s": tokens[0] / wall,
        "turns_s": turns[0] / wall,
        "tokens": tokens[0],
        "api_cores": (time.process_time() - cpu) / wall,
        "router": llm.stats()["router"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="dummy:tiny", help="its shape only: no weights are used")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--users", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=2.0, help="the stand-in replicas' step")
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument(
        "--stream-interval", type=int, default=None, help="the replicas' chunk: a delta every N steps (default: theirs)"
    )
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    args = ap.parse_args(argv)
    os.environ["CHATENGINE_API_BENCH_STEP_S"] = str(args.step_ms / 1000)  # the stand-ins read it
    from chatengine import DataParallelLLM
    from chatengine.engine.replicas import handle

    handle.replica = types.SimpleNamespace(main=stand_in_replica)  # what ReplicaHandle spawns
    llm = DataParallelLLM(
        args.model,
        data_parallel_size=args.replicas,
        device="cpu",
        register_personas=False,
        max_model_len=2048,
        stream_interval=args.stream_interval,
    )
    try:
        result = asyncio.run(relay(llm, args.users, args.seconds))
    finally:
        llm.shutdown()
    report, path = save_json("front_bench", args, argv, result)
    print(
        f"{result['output_tok_s']:,.0f} tok/s relayed, {result['turns_s']:.0f} turns/s, API process at "
        f"{result['api_cores']:.2f} cores; saved {path}",
        flush=True,
    )
    return report


if __name__ == "__main__":
    main()
