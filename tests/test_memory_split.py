"""--model repeats and --kv-memory-split shares the memory flags among the models; bad values are
refused before any model loads, and a model that fails to load stops those already started."""

import pytest

from chatengine.app import server
from chatengine.app.memory_split import parse_split, split_options


def test_equal_shares_without_a_split():
    assert parse_split(None, 1) == [1.0]
    assert parse_split("", 4) == [0.25] * 4


def test_a_split_gives_one_fraction_per_model():
    assert parse_split("0.6,0.4", 2) == [0.6, 0.4]
    assert parse_split(" 0.2, 0.3 ,0.5", 3) == [0.2, 0.3, 0.5]


@pytest.mark.parametrize(
    "text, n, words",
    [
        ("0.6", 2, "1 fractions for 2 models"),
        ("0.6,0.6", 2, "add up to 1"),
        ("1.2,-0.2", 2, "> 0"),
        ("a,b", 2, "separated by commas"),
        ("nan,0.5", 2, "add up to 1"),
    ],
)
def test_a_bad_split_is_refused(text, n, words):
    with pytest.raises(ValueError, match=words):
        parse_split(text, n)


def test_each_model_gets_its_share_of_every_budget():
    one, two = split_options({"kv_cache_gib": 2.0, "gpu_memory_utilization": 0.8, "device": "cpu"}, [0.75, 0.25])
    assert one["kv_cache_gib"] == 1.5 and two["kv_cache_gib"] == 0.5
    assert one["cpu_offload_gib"] == 0.375 and two["kv_store_gib"] == 2.0  # engine defaults 0.5 and 8 GiB
    # CUDA: an engine counts what the earlier ones hold as used, so its cap is the running total
    assert one["gpu_memory_utilization"] == pytest.approx(0.6) and two["gpu_memory_utilization"] == pytest.approx(0.8)
    assert one["device"] == two["device"] == "cpu"


def test_one_model_keeps_the_options_as_given():
    assert split_options({"kv_cache_gib": None}, [1.0]) == [{"kv_cache_gib": None}]


def test_model_repeats_on_the_command_line_and_help_says_so():
    p = server.build_parser()
    assert p.parse_args(["--model", "a", "--model", "b"]).model == ["a", "b"]
    assert p.parse_args([]).model is None
    text = " ".join(p.format_help().split())
    assert "--kv-memory-split" in text and "Repeat it to serve several models" in text


def test_a_bad_split_fails_before_any_model_loads(tmp_path):
    with pytest.raises(ValueError, match="2 fractions for 3 models"):
        server.create_app(data_dir=tmp_path, model=["dummy:tiny"] * 3, kv_memory_split="0.5,0.5")


def test_a_model_that_fails_to_load_stops_the_others(tmp_path, monkeypatch):
    from chatengine import AsyncLLM

    started = []
    real_init = AsyncLLM.__init__

    def recording_init(self, *args, **kw):
        real_init(self, *args, **kw)
        started.append(self)

    monkeypatch.setattr(AsyncLLM, "__init__", recording_init)
    with pytest.raises(ValueError, match="does not exist"):
        server.create_app(data_dir=tmp_path, model=["dummy:tiny", str(tmp_path / "no-such-model")], disk_kv=False)
    assert len(started) == 1 and not started[0].is_running
    with pytest.raises(ValueError, match="does not exist"):  # the data dir's lock was let go
        server.create_app(data_dir=tmp_path, model=str(tmp_path / "no-such-model"))


def test_default_names_the_embedded_model_beside_others(tmp_path, monkeypatch):
    assert server.model_names(None) is None
    assert server.model_names(["x"]) == "x"
    assert server.model_names(["default", "/m/tiny"]) == [None, "/m/tiny"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()  # a directory of that name is that directory
    assert server.model_names(["default", "b"]) == ["default", "b"]
