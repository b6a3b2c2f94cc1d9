"""ServedModels: the served engines by model id, the first the default; a request's name is looked
up exactly, never resolved to a path."""

import pytest

from chatengine.app.models import ServedModels, UnknownModel


class FakeEngine:
    def __init__(self, model_id, fail=False):
        self.model_id, self.fail, self.stopped = model_id, fail, False

    def shutdown(self):
        self.stopped = True
        if self.fail:
            raise RuntimeError("boom")


def test_engines_by_id_first_is_default():
    a, b = FakeEngine("a"), FakeEngine("b")
    models = ServedModels.of([a, b])
    assert models.ids == ["a", "b"] and models.default_id == "a" and models.default is a
    assert models.engine(None) is a and models.engine("") is a and models.engine("b") is b
    assert "b" in models and len(models) == 2 and models["b"] is b
    assert ServedModels.of(models) is models
    assert ServedModels.of(a).ids == ["a"]


@pytest.mark.parametrize("name", ["c", "A", "b ", "../a", "/etc/passwd", "dummy:tiny", "org/name"])
def test_an_unknown_name_is_refused_with_the_served_ids(name):
    models = ServedModels.of([FakeEngine("a"), FakeEngine("b")])
    with pytest.raises(UnknownModel, match="choose one of: a, b"):
        models.engine(name)


def test_two_engines_with_one_id_are_refused():
    with pytest.raises(ValueError, match="given twice"):
        ServedModels.of([FakeEngine("a"), FakeEngine("a")])
    with pytest.raises(ValueError, match="at least one"):
        ServedModels({})


def test_shutdown_stops_every_engine_even_if_one_fails():
    a, b = FakeEngine("a", fail=True), FakeEngine("b")
    ServedModels.of([a, b]).shutdown()
    assert a.stopped and b.stopped
