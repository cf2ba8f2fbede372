"""The contract every registered fusion method keeps (a new method is covered by registering it).

For each name in ``FUSION_METHODS``, on two tiny MLPs (and on 3, 5 and 10: every method fuses
more than two): the inputs are left as they were, the fused model has the requested spec and
runs, a seeded fusion is repeatable, the method and its config pickle, ``needs()`` covers what
it reads (any other input may go), and bad inputs get an error that names the field, the model
or the problem.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import pickle
import pydoc
import typing

import pytest
import torch

from fedfuse.fusion import (
    FUSION_METHODS,
    FusionInputs,
    FusionMethod,
    LocalSites,
    make_fusion_method,
)
from fedfuse.fusion.base import SITE_NEEDS
from fedfuse.fusion.inputs import INPUT_FIELDS, PER_MODEL_FIELDS
from fedfuse.fusion.methods.regression.regmean import level_grams
from fedfuse.fusion.statistics.fisher import FISHER_KINDS, site_fisher
from fedfuse.models import build_model, mlp_spec
from tests.helpers import randn

SPEC = mlp_spec((1, 4, 4), 3, (6, 5))
NAMES = sorted(FUSION_METHODS)
#: options that keep the methods which train short (others run with their defaults)
FAST = {
    "dense": {"epochs": 2},
    "kd": {"epochs": 2},
    "linear-probe": {"epochs": 2},
    "fs-merge": {"epochs": 3},
    "hf-gradient": {"epochs": 2, "last_epochs": 2},
    "kf-gradient": {"epochs": 2, "last_epochs": 2},
    "auto": {"candidates": "hf-linear,regmean,fedavg"},
}


pytestmark = pytest.mark.usefixtures("one_thread")


def method(name: str, **extra):
    options = dict(FAST.get(name, {}), **extra)
    if "device" in FUSION_METHODS[name].accepted_options():
        options.setdefault("device", "cpu")
    return make_fusion_method(name, **options)


@pytest.fixture(scope="module")
def models():
    return [build_model(SPEC, seed=seed).eval() for seed in (0, 1)]


@pytest.fixture(scope="module")
def full(models):
    """Every FusionInputs field, well-formed."""
    generator = torch.Generator().manual_seed(5)
    data = randn(1, 24, 1, 4, 4)
    return FusionInputs(
        data=data,
        labels=torch.randint(0, 3, (24,), generator=generator),
        scores=[
            {i: torch.rand(m.level_width(i), generator=generator) + 0.1 for i in m.neuron_levels}
            for m in models
        ],
        sample_counts=[30, 50],
        class_counts=[[10, 15, 5], [20, 0, 30]],
        grams=[level_grams(m, randn(10 + k, 16, 1, 4, 4)) for k, m in enumerate(models)],
        fisher=[
            site_fisher(m, randn(30 + k, 16, 1, 4, 4), FISHER_KINDS) for k, m in enumerate(models)
        ],
        sites=LocalSites(
            models, [randn(20 + k, 16, 1, 4, 4) for k in range(len(models))], device="cpu"
        ),
    )


def inputs_for(models, seed: int = 5) -> FusionInputs:
    """Every FusionInputs field, well-formed, for ``models``."""
    generator = torch.Generator().manual_seed(seed)
    return FusionInputs(
        data=randn(1, 24, 1, 4, 4),
        labels=torch.randint(0, 3, (24,), generator=generator),
        scores=[
            {i: torch.rand(m.level_width(i), generator=generator) + 0.1 for i in m.neuron_levels}
            for m in models
        ],
        sample_counts=[30 + 20 * k for k in range(len(models))],
        class_counts=[[10 + k, 15 * (k % 2), 5 + 2 * k] for k in range(len(models))],
        grams=[level_grams(m, randn(10 + k, 16, 1, 4, 4)) for k, m in enumerate(models)],
        fisher=[
            site_fisher(m, randn(30 + k, 16, 1, 4, 4), FISHER_KINDS) for k, m in enumerate(models)
        ],
        sites=LocalSites(
            models, [randn(20 + k, 16, 1, 4, 4) for k in range(len(models))], device="cpu"
        ),
    )


def without(inputs: FusionInputs, *names: str, **changes) -> FusionInputs:
    return dataclasses.replace(inputs, **{n: None for n in names}, **changes)


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_weights(a, b) -> None:
    assert a.spec == b.spec
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def _snapshot(inputs: FusionInputs) -> FusionInputs:
    return copy.deepcopy(inputs)


def _assert_inputs_equal(before: FusionInputs, after: FusionInputs) -> None:
    assert before.data is not None and after.data is not None
    assert torch.equal(before.data, after.data)
    assert torch.equal(before.labels, after.labels)
    for old, new in zip(before.scores, after.scores, strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    for old, new in zip(before.grams, after.grams, strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    for old, new in zip(before.fisher, after.fisher, strict=True):
        assert old.keys() == new.keys() and all(torch.equal(old[k], new[k]) for k in old)
    assert list(before.sample_counts) == list(after.sample_counts)
    assert [list(c) for c in before.class_counts] == [list(c) for c in after.class_counts]


# ---------------------------------------------------------------------------------- behaviour
@pytest.mark.parametrize("name", NAMES)
def test_fusion_leaves_the_models_and_inputs_as_they_were(name, models, full):
    models = [copy.deepcopy(m) for m in models]
    states = [state(m) for m in models]
    flags = [(m.training, [p.requires_grad for p in m.parameters()]) for m in models]
    inputs = _snapshot(full)
    method(name).fuse(models, inputs)
    for model, before, (training, grads) in zip(models, states, flags, strict=True):
        after = model.state_dict()
        assert before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before), name
        assert model.training == training
        assert [p.requires_grad for p in model.parameters()] == grads
    _assert_inputs_equal(full, inputs)


@pytest.mark.parametrize("name", NAMES)
def test_the_fused_model_has_the_requested_spec_and_runs(name, models, full):
    cls = FUSION_METHODS[name]
    x = randn(3, 7, 1, 4, 4)
    for target in (None, SPEC):
        fused = method(name).fuse(models, full, target=target).model
        if cls.chooses_widths:
            assert fused.spec.with_widths(SPEC.widths) == SPEC
        else:
            assert fused.spec == SPEC
        with torch.no_grad():
            logits = fused(x)
        assert logits.shape == (7, 3) and torch.isfinite(logits).all()
    if cls.retargetable:
        narrow = SPEC.with_widths((5, 4))
        try:
            fused = method(name).fuse(models, full, target=narrow).model
        except ValueError as error:  # a method may decline another target, saying why
            assert name in str(error)
        else:
            if cls.chooses_widths:
                assert all(w <= c for w, c in zip(fused.spec.widths, narrow.widths, strict=True))
            else:
                assert fused.spec == narrow


@pytest.mark.parametrize("count", [3, 5, 10])
@pytest.mark.parametrize("name", NAMES)
def test_every_method_fuses_more_than_two_models(name, count):
    many = [build_model(SPEC, seed=seed).eval() for seed in range(count)]
    fusion = method(name)
    fusion.check_run(count, SPEC)
    fused = fusion.fuse(many, inputs_for(many)).model
    if FUSION_METHODS[name].chooses_widths:
        assert fused.spec.with_widths(SPEC.widths) == SPEC
    else:
        assert fused.spec == SPEC
    with torch.no_grad():
        logits = fused(randn(3, 7, 1, 4, 4))
    assert logits.shape == (7, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize("name", NAMES)
def test_a_seeded_fusion_is_repeatable(name, models, full):
    first = method(name).fuse(models, full).model
    second = method(name).fuse(models, full).model
    assert_same_weights(first, second)


@pytest.mark.parametrize("name", NAMES)
def test_the_method_and_its_config_pickle(name, models, full):
    fusion = method(name)
    expected = fusion.fuse(models, full).model
    again = pickle.loads(pickle.dumps(fusion))
    assert type(again) is type(fusion) and again.options() == fusion.options()
    assert_same_weights(again.fuse(models, full).model, expected)
    config = fusion.config()
    restored = pickle.loads(pickle.dumps(config))
    assert restored == config and type(restored) is FUSION_METHODS[name].config_class()
    assert_same_weights(
        FUSION_METHODS[name].from_config(restored).fuse(models, full).model, expected
    )


@pytest.mark.parametrize("name", NAMES)
def test_needs_cover_what_the_method_reads(name, models, full):
    fusion = method(name)
    needs, required = fusion.needs(), fusion.requirements()
    assert type(fusion).requires <= required <= needs
    # the fields read: the sites serve both statistics rounds and scores (site_scores)
    fields = {"sites" if need in SITE_NEEDS else need for need in needs}
    assert fields <= set(INPUT_FIELDS)
    expected = fusion.fuse(models, full).model
    unused = sorted(set(INPUT_FIELDS) - fields)
    # every field outside needs() may go at once: the fused model is the same
    assert_same_weights(fusion.fuse(models, without(full, *unused)).model, expected)
    for field in sorted(fields - required):  # used when given, with a fallback otherwise
        fused = fusion.fuse(models, without(full, field)).model
        assert fused.spec.with_widths(SPEC.widths) == SPEC
    for field in sorted(required):
        with pytest.raises(ValueError, match=rf"{name}: needs FusionInputs\.{field}\b"):
            fusion.fuse(models, without(full, field))


# ---------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("name", NAMES)
def test_a_model_of_another_architecture_is_named(name, models, full):
    other_classes = build_model(mlp_spec((1, 4, 4), 4, (6, 5)), seed=2)
    with pytest.raises(ValueError, match=rf"{name}: model 1 "):
        method(name).fuse([models[0], other_classes], full)
    if FUSION_METHODS[name].same_spec:
        deeper = build_model(mlp_spec((1, 4, 4), 3, (6, 5, 4)), seed=2)
        with pytest.raises(ValueError, match=rf"{name}: model 1 "):
            method(name).fuse([models[0], deeper], full)


@pytest.mark.parametrize("name", NAMES)
def test_inputs_of_the_wrong_length_are_named(name, models, full):
    for field in PER_MODEL_FIELDS:
        short = without(full, **{field: list(getattr(full, field))[:1]})
        with pytest.raises(ValueError, match=rf"FusionInputs\.{field} has 1 entries for 2 models"):
            method(name).fuse(models, short)


@pytest.mark.parametrize("name", NAMES)
def test_malformed_inputs_the_method_needs_are_named(name, models, full):
    fusion = method(name)
    needs = fusion.needs()
    cases: list[tuple[FusionInputs, str]] = []
    if "scores" in needs:
        scores = [dict(s) for s in full.scores]
        level = models[1].neuron_levels[0]
        scores[1][level] = torch.full_like(scores[1][level], float("nan"))
        cases.append((without(full, scores=scores), r"scores of model 1.*finite"))
    if "data" in needs:
        cases.append((without(full, data=randn(4, 24, 1, 5, 5)), r"FusionInputs\.data has"))
        nan = full.data.clone()
        nan[3, 0, 1, 1] = float("nan")
        cases.append((without(full, data=nan), r"FusionInputs\.data has NaN"))
    if "labels" in needs:
        cases.append((without(full, labels=full.labels[:-2]), r"22 labels for 24 fusion samples"))
        cases.append((without(full, labels=full.labels + 3), r"labels must be class indices"))
    if "sample_counts" in needs:
        cases.append((without(full, sample_counts=[30, -1]), r"sample count of model 1"))
    if "class_counts" in needs:
        cases.append((without(full, class_counts=[[1, 2, 3], [1, 2]]), r"class counts of model 1"))
    for inputs, message in cases:
        with pytest.raises(ValueError, match=message):
            fusion.fuse(models, inputs)


# ---------------------------------------------------------------------------------- declaration
@pytest.mark.parametrize("name", NAMES)
def test_the_config_class_is_the_constructor(name):
    cls = FUSION_METHODS[name]
    config = cls.config_class()
    assert config is cls.config_class()  # built once
    assert config.__name__ == f"{cls.__name__}Config"
    hints = {}
    for init in reversed(cls.option_constructors()):  # the nearest declaration wins
        hints.update(typing.get_type_hints(init))
    fields = dataclasses.fields(config)
    assert [f.name for f in fields] == cls.accepted_options()
    for f in fields:
        assert f.default == cls.option_defaults()[f.name]
        assert f.type == hints.get(f.name, typing.Any)
    default = config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        default.seed = 1  # type: ignore[misc]
    assert cls.from_config(default).options() == make_fusion_method(name).options()
    assert cls.from_config(dict(cls.option_defaults())).options() == default.__dict__
    with pytest.raises(ValueError, match=rf"fusion method '{name}' has no option\(s\) \['bogus'\]"):
        cls.from_config({"bogus": 1})
    with pytest.raises(TypeError, match="from_config takes"):
        cls.from_config(42)


@pytest.mark.parametrize("name", NAMES)
def test_the_class_documents_its_options(name):
    cls = FUSION_METHODS[name]
    assert cls.__module__.startswith("fedfuse.fusion.") and cls.__doc__
    constructors = cls.option_constructors()
    if constructors:
        parameters = inspect.signature(constructors[-1]).parameters.values()
        assert not any(p.kind is p.VAR_KEYWORD for p in parameters)
        text = pydoc.render_doc(cls, renderer=pydoc.plaintext)
        assert all(option in text for option in cls.accepted_options())


def test_wrong_option_types_are_named():
    with pytest.raises(ValueError, match=r"'kf-linear': option ridge='abc' must be float or None"):
        make_fusion_method("kf-linear", ridge="abc")
    with pytest.raises(ValueError, match=r"'kf-linear': option ridge='abc' must be float or None"):
        FUSION_METHODS["kf-linear"].config_class()(ridge="abc")
    with pytest.raises(ValueError, match=r"no option\(s\) \['ridge'\]"):
        make_fusion_method("kf-gradient", ridge=0.1)


class _Parent(FusionMethod):
    """A method with two options, for the inherited-options test (not registered)."""

    name = "parent"

    def __init__(self, *, epochs: int = 3, lr: float = 0.1) -> None:
        self.epochs = epochs
        self.lr = lr

    def _fuse(self, models, inputs, target):
        raise NotImplementedError


class _Child(_Parent):
    """Adds ``mode`` and forwards the parent's options."""

    name = "child"

    def __init__(self, mode: str = "a", **inherited: typing.Any) -> None:
        super().__init__(**inherited)
        self.mode = mode


class _ShortChild(_Child):
    """Declares an inherited option again, with another default."""

    name = "short-child"

    def __init__(self, *, epochs: int = 1, **inherited: typing.Any) -> None:
        super().__init__(epochs=epochs, **inherited)


def test_a_subclass_has_its_own_options_then_its_parents():
    assert _Parent.accepted_options() == ["epochs", "lr"]
    assert _Child.option_defaults() == {"mode": "a", "epochs": 3, "lr": 0.1}
    assert _ShortChild.option_defaults() == {"epochs": 1, "mode": "a", "lr": 0.1}
    config = _Child.config_class()
    types = {f.name: f.type for f in dataclasses.fields(config)}
    assert types == {"mode": str, "epochs": int, "lr": float}
    child = _Child.from_config({"mode": "b", "epochs": 5})
    assert child.options() == {"mode": "b", "epochs": 5, "lr": 0.1}
    assert child.config() == config(mode="b", epochs=5)
    assert _ShortChild().options() == {"epochs": 1, "mode": "a", "lr": 0.1}
    for options, named in (({"mode": 1}, r"mode=1 must be str"), ({"lr": "x"}, r"lr='x' must be")):
        with pytest.raises(ValueError, match=rf"'child': option {named}"):
            _Child.from_config(options)
    accepted = r"\['mode', 'epochs', 'lr'\]"
    with pytest.raises(ValueError, match=rf"'child' has no option\(s\) \['bogus'\]; .*{accepted}"):
        _Child.from_config({"bogus": 1})
    with pytest.raises(ValueError, match=r"'child': option epochs=-1 is out of range"):
        _Child(epochs=-1)
