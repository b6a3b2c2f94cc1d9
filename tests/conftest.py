"""Shared fixtures: the default model loaded once per session, tiny random models, a check that
every test leaves all KV blocks free, and real servers on loopback."""

import os

# One torch thread per test process: CI runs two xdist workers on two cores, and with a thread per
# core each worker's parallel regions wait at barriers for threads the other worker holds (a small
# linear ran 3-6x slower). Servers and CLIs the tests start inherit it through the environment.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
if not torch.cuda.is_available():  # Triton kernels run under the interpreter on CPU (set before triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from chatengine import LLM  # noqa: E402
from chatengine.app.store import ChatStore  # noqa: E402


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


# the asynchronous variants run with the whole suite, not in CI (its 10 minutes): CI keeps
# test_engine.py's own check that async scheduling gives the synchronous tokens, and the async
# fixture's other users
@pytest.fixture(params=["sync", pytest.param("async", marks=pytest.mark.slow)])
def either(request):
    """The default model scheduled synchronously, then asynchronously: the same tests hold for both."""
    return request.getfixturevalue("llm" if request.param == "sync" else "llm_async")


@pytest.fixture
def store(tmp_path):
    """An empty chat database of this test's own."""
    s = ChatStore(tmp_path / "chat.db")
    yield s
    s.close()


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server of this test session (Debian's packages; ~2 s to start): ``postgres.new_schema()``
    is the URL of an empty schema of one's own. Skips where PostgreSQL or psycopg is not installed."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e '.[postgres]')")
    from postgres_server import PostgresServer

    server = PostgresServer.start()
    if server is None:
        pytest.skip("no PostgreSQL server here (apt-get install postgresql)")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny():
    """A 2-layer random model with a 256-token vocabulary (token-id prompts only)."""
    return LLM("dummy:tiny", num_kv_blocks=64, max_num_batched_tokens=64)


@pytest.fixture
def row_exact_dot(monkeypatch):
    """Under Triton's interpreter, tl.dot as the compiled kernels compute it, row-exact and in k
    order: each output element one accumulator, fed k16 steps one after another (numpy's einsum
    loops, no BLAS, one memory layout). numpy's BLAS matmul may round a row by its place in the
    tile, and one einsum over a whole BLOCK_K step would make the bits depend on BLOCK_K, which on
    the GPU they do not (k16 tensor-core steps into one fp32 accumulator whatever the step)."""
    import numpy as np
    from triton.runtime import interpreter

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = a.data, b.data
        out = d.data.copy()
        for k in range(0, a.shape[-1], 16):  # k16 steps, each a contiguous einsum (its sum order)
            x, y = np.ascontiguousarray(a[..., k : k + 16]), np.ascontiguousarray(b[..., k : k + 16, :])
            out += np.einsum("...mk,...kn->...mn", x, y, optimize=False).astype(out.dtype)
        return interpreter.TensorHandle(out, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)


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


# a chat template unlike the default's ChatML ("<role> says"): a reply whose prompt holds it was
# templated with this model's own files
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} says\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant says\n{% endif %}"
)


def save_tiny_chat_model(path, seed: int = 0):
    """A 2-layer random Llama with the default model's tokenizer under its own chat template, saved
    with save_pretrained into ``path``: a second chat model, loaded in a second (~1 s)."""
    import transformers

    from chatengine.engine.loader import _convert_gguf, _gguf_digest, default_gguf_path

    gguf = default_gguf_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(_convert_gguf(gguf, _gguf_digest(gguf)))
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory):
    """The directory of a tiny random chat model (see save_tiny_chat_model)."""
    return save_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
