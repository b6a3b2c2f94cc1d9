"""Two models served at once never share KV pages: the hash chain's root covers the model's
fingerprint (id and weights digest), so the same prompt, by the same user, with the same server
secret and the same disk tier directory, hits only pages its own model wrote."""

import pytest
import torch

from chatengine import LLM, SamplingParams

transformers = pytest.importorskip("transformers")

PROMPT = list(range(1, 70))  # four full 16-token blocks
ONE = SamplingParams(temperature=0, max_tokens=1)


def save_tiny(path, seed: int):
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        eos_token_id=255,
    )
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


def cached(llm) -> int:
    return llm.generate([PROMPT], ONE, user="alice")[0].num_cached_tokens


def test_the_same_prompt_on_two_models_never_shares_pages(tmp_path):
    a_dir, b_dir = save_tiny(tmp_path / "a", 0), save_tiny(tmp_path / "b", 1)
    shared = dict(kv_store_dir=str(tmp_path / "kv"), data_dir=str(tmp_path), num_kv_blocks=64)
    a = LLM(a_dir, **shared)
    try:
        assert cached(a) == 0 and cached(a) >= 48  # a's second run hits its own pages
    finally:
        a.shutdown()  # a's pages go to the disk tier
    a, b = LLM(a_dir, **shared), LLM(b_dir, **shared)  # side by side, as a server of both
    try:
        assert cached(b) == 0  # nothing of a's: not on disk, not in a's pool
        assert cached(a) >= 48  # though a's pages are there, on disk
    finally:
        a.shutdown()
        b.shutdown()
