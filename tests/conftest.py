"""Shared fixtures: the default model loaded once per session, tiny random models, a check that
every test leaves all KV blocks free, and real servers on loopback."""

import os

import pytest
import torch

if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from chatengine import LLM  # noqa: E402


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2-135M-Instruct on CPU, fp32 (loaded once: ~5 s): quantization="none", so
    the tests comparing it with transformers run the fp32 path (the CPU default keeps the GGUF's blocks)."""
    engine = LLM(max_num_batched_tokens=512, kv_cache_gib=0.25, quantization="none")
    yield engine
    engine.shutdown()


@pytest.fixture(scope="session")
def llm_async():
    """The default model with async scheduling (CUDA's default; off on CPU): step N+1 is scheduled on
    placeholders before step N's tokens are processed. Checks invariants every step."""
    engine = LLM(
        max_num_batched_tokens=512, kv_cache_gib=0.25, async_scheduling=True, debug_checks=True, quantization="none"
    )
    yield engine
    engine.shutdown()


@pytest.fixture(params=["sync", "async"])
def either(request):
    """The default model scheduled synchronously, then asynchronously: the same tests hold for both."""
    return request.getfixturevalue("llm" if request.param == "sync" else "llm_async")


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random model with a 256-token vocabulary (token-id prompts only)."""
    return LLM("dummy:tiny", num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture(autouse=True)
def blocks_drain(request):
    """After every test, every engine fixture it used has no request left and no block in use."""
    yield
    for name in ("llm", "llm_async", "tiny"):
        if name in request.fixturenames:
            engine = request.getfixturevalue(name).engine
            assert not engine.requests, f"{name}: requests left behind: {list(engine.requests)}"
            used = engine.block_manager.num_blocks - engine.block_manager.num_free_blocks
            assert used == 0, f"{name}: {used} KV blocks still in use after the test"
            engine.check_invariants()


@pytest.fixture(scope="module")
def serve():
    """Starts ASGI apps under uvicorn on 127.0.0.1, each in a thread of this process: ``serve(app).url``.
    They stop when the module's tests are done."""
    pytest.importorskip("uvicorn")
    from chatengine.app.server import ServerThread

    servers = []

    def start(app) -> ServerThread:
        servers.append(ServerThread(app))
        return servers[-1]

    yield start
    for server in reversed(servers):
        server.stop()
