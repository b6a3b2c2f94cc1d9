"""Loading weights: dummy shapes, a Hugging Face directory (weights as saved, config mapped, the
digest follows the weights), and clear errors for what cannot be loaded."""

import json

import pytest
import torch

from chatengine.engine.loader import DUMMY_SHAPES, load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A tiny random Qwen2-shaped model saved with save_pretrained (biases on q/k/v, untied head)."""
    cfg = transformers.Qwen2Config(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        eos_token_id=7,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg)
    path = tmp_path_factory.mktemp("qwen2-tiny")
    model.save_pretrained(path)
    return path, model.state_dict()


def test_dummy_shapes_build_their_config():
    loaded = load_model("dummy:tiny", seed=3)
    shape = DUMMY_SHAPES["tiny"]
    assert loaded.config.vocab_size == shape["vocab_size"] and loaded.config.num_layers == shape["num_layers"]
    assert loaded.tokenizer is None and loaded.hf_dir is None
    again = load_model("dummy:tiny", seed=3)
    other = load_model("dummy:tiny", seed=4)
    name = next(iter(loaded.state_dict))
    assert torch.equal(loaded.state_dict[name], again.state_dict[name])  # a seed makes the same weights
    assert not torch.equal(loaded.state_dict[name], other.state_dict[name])
    assert loaded.weights_digest == again.weights_digest != other.weights_digest


def test_hf_directory_loads_as_saved(hf_dir):
    path, saved = hf_dir
    loaded = load_model(str(path))
    c = loaded.config
    assert (c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (128, 32, 2, 4, 2, 8)
    assert c.attention_bias and not c.tie_word_embeddings and 7 in c.eos_token_ids
    assert set(loaded.state_dict) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded.state_dict[name], tensor), name
    assert loaded.hf_dir == str(path) and loaded.tokenizer is None  # no tokenizer files saved


def test_the_digest_follows_the_weights(hf_dir, tmp_path):
    path, _ = hf_dir
    first = load_model(str(path)).weights_digest
    assert load_model(str(path)).weights_digest == first
    copy = tmp_path / "changed"
    copy.mkdir()
    for f in path.iterdir():
        (copy / f.name).write_bytes(f.read_bytes())
    shard = next(copy.glob("*.safetensors"))
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one changed byte in the last weights
    shard.write_bytes(bytes(data))
    assert load_model(str(copy)).weights_digest != first


@pytest.mark.parametrize(
    "model, message",
    [
        ("dummy:no-such-shape", "unknown dummy shape"),
        ("/no/such/path", "does not exist"),
    ],
)
def test_what_cannot_load_is_named(model, message):
    with pytest.raises(ValueError, match=message):
        load_model(model)


def test_a_directory_without_weights_or_config(tmp_path):
    with pytest.raises(ValueError, match="not a Hugging Face model directory"):
        load_model(str(tmp_path))
    (tmp_path / "config.json").write_text(
        json.dumps(
            {"model_type": "llama", "vocab_size": 8, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 1}
        )
    )
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_model(str(tmp_path))


def test_a_file_that_is_not_gguf(tmp_path):
    bogus = tmp_path / "model.bin"
    bogus.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ValueError, match="bad magic"):
        load_model(str(bogus))


def _with_generation_config(hf_dir, tmp_path, text: str):
    import shutil

    path, _ = hf_dir
    copy = tmp_path / "gen"
    shutil.copytree(path, copy)
    (copy / "generation_config.json").write_text(text)
    return copy


def test_generation_config_gives_the_sampling_defaults(hf_dir, tmp_path):
    gen = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 512}
    path = _with_generation_config(hf_dir, tmp_path, json.dumps({**gen, "do_sample": True, "eos_token_id": [7, 9]}))
    loaded = load_model(str(path))
    assert loaded.config.generation_defaults == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "repetition_penalty": 1.05,
        "max_tokens": 512,
    }
    assert {7, 9} <= set(loaded.config.eos_token_ids)


def test_generation_config_values_of_the_wrong_kind_are_left_out(hf_dir, tmp_path):
    bad = {"temperature": "hot", "top_p": 5, "top_k": 2.5, "repetition_penalty": 0, "max_new_tokens": True}
    path = _with_generation_config(hf_dir, tmp_path, json.dumps(bad))
    assert load_model(str(path)).config.generation_defaults == {}


def test_an_unreadable_generation_config_is_named(hf_dir, tmp_path):
    path = _with_generation_config(hf_dir, tmp_path, "{not json")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_model(str(path))


def test_the_embedded_default_has_its_model_cards_settings(llm):
    assert llm.generation_defaults == {"temperature": 0.2, "top_p": 0.9}


def _hf_cache_layout(hf_dir, cache, repo_id: str):
    """The local HF cache's layout for repo_id: refs/main names a snapshot holding the files."""
    path, _ = hf_dir
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    for f in path.iterdir():
        (snapshot / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("a" * 40)


def test_a_repo_id_resolves_from_the_local_hf_cache(hf_dir, tmp_path, monkeypatch):
    _hf_cache_layout(hf_dir, tmp_path, "acme/tiny-qwen2")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    loaded = load_model("acme/tiny-qwen2")
    assert loaded.hf_dir == str(tmp_path / "models--acme--tiny-qwen2" / "snapshots" / ("a" * 40))
    assert loaded.config.vocab_size == 128 and loaded.config.attention_bias
    with pytest.raises(ValueError, match="not in the local Hugging Face cache"):
        load_model("acme/not-cached")


def test_safetensors_are_read_whole_without_a_memory_map(tmp_path):
    # plain reads: a mapping's pages would count in RSS for the whole (quantizing) load
    from safetensors.torch import load_file, save_file

    from chatengine.engine.loader import _safetensors_weights

    tensors = {
        "a": torch.randn(3, 5),
        "b": torch.randn(4, 2).to(torch.bfloat16),
        "c": torch.tensor(7, dtype=torch.int64),
        "d": torch.zeros(0, 3, dtype=torch.float16),
        "e": torch.tensor([True, False]),
    }
    save_file(tensors, tmp_path / "x.safetensors")
    got = _safetensors_weights([tmp_path / "x.safetensors"])
    want = load_file(tmp_path / "x.safetensors")
    assert sorted(got) == sorted(want)
    for name in list(got):
        t = got.pop(name)
        assert t.dtype == want[name].dtype and torch.equal(t, want[name])
