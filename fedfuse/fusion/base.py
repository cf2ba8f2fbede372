"""The interface every fusion method implements (:class:`FusionMethod`) and its result.

A fusion method is a class whose constructor takes exactly its hyper-parameters (so a Hydra
config or a Flower run config instantiates it with no glue) and whose :meth:`FusionMethod.fuse`
takes the base models plus what the server knows about them (:class:`FusionInputs`) and returns a
new model. Methods never modify the models they are given.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from torch import nn

from fedfuse.fusion.blocks.alignment import affine_levels
from fedfuse.fusion.bounds import OPTION_BOUNDS, bounds_checked
from fedfuse.fusion.inputs import FusionInputs, check_inputs
from fedfuse.fusion.options import (
    check_options,
    config_class_of,
    config_values,
    declared_options,
    forwards_options,
)
from fedfuse.models import LeveledModel, ModelAdapter, ModelSpec, build_model
from fedfuse.models.adapter import infer_input_shape, known_input_shape
from fedfuse.runtime import release_free_memory

log = logging.getLogger(__name__)


@dataclass
class FusionResult:
    """The fused model, the wall time of the fusion and method-specific details.

    ``model`` is a :class:`LeveledModel`, or an instance of the user's own class with the
    user's parameter names when plain ``nn.Module`` s were fused.
    """

    model: LeveledModel | nn.Module
    seconds: float
    details: dict[str, Any] = field(default_factory=dict)

    def missing_sites(self, fused: int) -> list[int]:
        """Of the ``fused`` models' sites (by index), those a method fitted on the sites' data
        went without: the sites of no summed round (``details["sites"]``) or dropped in a
        statistics round (``details["levels"][i]["dropped_sites"]``). Empty for the others."""
        missing: set[int] = set()
        if isinstance(self.details.get("sites"), list):
            missing |= set(range(fused)) - set(self.details["sites"])
        for level in self.details.get("levels") or []:
            if isinstance(level, dict):
                missing |= set(level.get("dropped_sites") or [])
        return sorted(missing)


class FusionMethod(ABC):
    """Base class of fusion methods: validate, time, and delegate to :meth:`_fuse`.

    What a method reads is declared, not guessed: the class attribute :attr:`requires` (fields
    of :class:`FusionInputs` it cannot work without, whatever its options), and per configured
    instance :meth:`requirements` (those its options make indispensable too) and :meth:`needs`
    (every field it reads). Its options are its constructor's keyword arguments, also as a
    frozen dataclass (:meth:`config_class`, :meth:`from_config`, :meth:`config`).

    A subclass that adds options to a parent's declares only its own and forwards the rest::

        def __init__(self, student_init: str = "first", **inherited: Any) -> None:
            super().__init__(**inherited)

    Its options are then its own followed by the parent's (:meth:`option_constructors`: along
    the MRO up to the first ``__init__`` without ``**``), each with the type hint and default of
    the constructor that declares it; configs, type and range checks read them all.
    """

    #: registry name, e.g. ``"fedavg"``
    name: ClassVar[str]
    #: fields of :class:`FusionInputs` the method cannot work without, whatever its options
    requires: ClassVar[frozenset[str]] = frozenset()
    #: whether base models must share one architecture spec exactly
    same_spec: ClassVar[bool] = True
    #: whether the fused model may have another spec (e.g. other widths) than the base models
    retargetable: ClassVar[bool] = False
    #: what the method is, for labels in result tables ("fusion", or e.g. a reference point)
    kind: ClassVar[str] = "fusion"
    #: whether the method decides the fused widths itself (an explicit target's widths then only
    #: cap them), so the fused spec may differ from the requested one in its widths
    chooses_widths: ClassVar[bool] = False
    #: the most base models the method can fuse (None: any number)
    max_models: ClassVar[int | None] = None
    #: whether every level with neurons must be affine (parameter-free ops, then one Linear or
    #: Conv2d), as closed-form refits and Gram-based merges need
    needs_affine_levels: ClassVar[bool] = False
    #: allowed ranges of this method's options where they differ from :data:`OPTION_BOUNDS`
    option_bounds: ClassVar[Mapping[str, tuple[float, float]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every constructor checks its count options against :meth:`option_range` first."""
        super().__init_subclass__(**kwargs)
        init = cls.__dict__.get("__init__")
        if init is not None and not getattr(init, "_checks_bounds", False):
            cls.__init__ = bounds_checked(init)  # type: ignore[method-assign]

    @classmethod
    def option_range(cls, option: str) -> tuple[float, float] | None:
        """The allowed ``(low, high)`` of a numeric option (None: unbounded)."""
        return cls.option_bounds.get(option, OPTION_BOUNDS.get(option))

    def fuse(
        self,
        models: Sequence[LeveledModel | nn.Module],
        inputs: FusionInputs | None = None,
        *,
        target: ModelSpec | None = None,
    ) -> FusionResult:
        """Fuse ``models`` into one model of spec ``target`` (default: the first model's).

        ``models`` are fedfuse's :class:`LeveledModel` s or instances of one plain
        ``nn.Module`` class: those are adapted (:class:`~fedfuse.models.ModelAdapter`, on the
        input shape of ``inputs.data``, else the sites', the class's last adapter's or one its
        first layer takes: methods without a fusion set need none) and the fused model comes
        back as that class. A single model with another ``target`` (narrower, or shallower) is
        *compression* (paper Sec. 5.5.2), open to retargetable methods.
        """
        inputs = inputs or FusionInputs()
        # a lazy sequence (fedfuse.federation.uploads) loads each model once here
        models = list(models)
        adapter = plain_model_adapter(models, inputs)
        if adapter is not None:
            if self.chooses_widths or (target is not None and target != adapter.spec):
                raise ValueError(
                    f"{self.name}: a plain {adapter.model_class.__name__} keeps the widths its "
                    "class defines, and this method would change them"
                )
            models = [adapter.adapt(m) for m in models]
        compressing = len(models) == 1 and target is not None and target != models[0].spec
        if compressing and not self.retargetable:
            raise ValueError(
                f"{self.name}: fuses into the base models' own architecture, so it cannot "
                "compress one model into another spec"
            )
        self._check(models, inputs, single=True) if compressing else self._check(models, inputs)
        target = target or models[0].spec
        if target != models[0].spec and not self.retargetable:
            raise ValueError(
                f"{self.name}: fuses only into the base models' own architecture "
                f"{models[0].spec.to_dict()}, not {target.to_dict()}"
            )
        started = time.perf_counter()
        model, details = self._fuse(list(models), inputs, target)
        release_free_memory()  # what the fusion freed goes back now, not when the process ends
        seconds = time.perf_counter() - started
        log.info("%s fused %d models in %.2f s", self.name, len(models), seconds)
        if adapter is not None:
            model = adapter.export(model)
        return FusionResult(model=model, seconds=seconds, details=details)

    @abstractmethod
    def _fuse(
        self, models: list[LeveledModel], inputs: FusionInputs, target: ModelSpec
    ) -> tuple[LeveledModel, dict[str, Any]]:
        """Produce the fused model and a details dict; inputs are already validated."""

    def check_run(
        self,
        num_models: int,
        spec: ModelSpec | None = None,
        available: Iterable[str] | None = None,
        target: ModelSpec | None = None,
        *,
        wording: Mapping[str, str] | None = None,
    ) -> None:
        """Raise ValueError, naming the method, unless it can fuse this run's models.

        Meant to be called before any site trains: ``num_models`` sites of architecture
        ``spec`` (None: not known yet), with the :class:`FusionInputs` fields ``available``
        (None: all of them), into ``target`` (None: the sites' spec). Cheap: the specs are
        built on the meta device. ``wording``: how a missing field reads for this caller (e.g.
        the argument of a plain Flower app's strategy that gives it), over fedfuse's app's.
        """
        needs = {**INPUT_NEEDS, **(wording or {})}
        if target is not None and spec is not None and target != spec:
            if not self.retargetable:
                raise ValueError(
                    f"{self.name}: fuses only into the sites' own architecture, not the "
                    f"requested fused widths {list(target.widths)}"
                )
            self.check_target(spec, target)
            try:
                self.check_architecture(build_model(target, device="meta"))
            except ValueError as error:
                raise ValueError(f"{self.name}: cannot fuse into {target.arch}: {error}") from None
        if num_models < 2:
            raise ValueError(f"{self.name}: fusion needs at least 2 models, got {num_models}")
        if self.max_models is not None and num_models > self.max_models:
            raise ValueError(
                f"{self.name} fuses at most {self.max_models} models, got {num_models}; "
                "for more, use kf-linear, otfusion, fedma, regmean or fedavg"
            )
        if available is not None:
            lacking = sorted(self.requirements() - set(available))
            if lacking:
                raise ValueError(
                    f"{self.name}: needs {', '.join(needs.get(n, n) for n in lacking)}, "
                    "which this run does not provide"
                )
        if spec is not None:
            try:
                self.check_architecture(build_model(spec, device="meta"))
            except ValueError as error:
                raise ValueError(f"{self.name}: cannot fuse {spec.arch} models: {error}") from None

    def check_target(self, spec: ModelSpec, target: ModelSpec) -> None:
        """Raise ValueError unless this configuration of a retargetable method can fuse sites
        of ``spec`` into the other spec ``target`` (by default it can)."""
        return None

    def check_architecture(self, model: LeveledModel) -> None:
        """Raise ValueError unless the method can fuse models built like ``model`` (built on
        the meta device: structure only). By default, methods with :attr:`needs_affine_levels`
        need every neuron level affine; methods override this for other structural needs."""
        if self.needs_affine_levels:
            affine_levels(model)

    def _check(
        self, models: Sequence[LeveledModel], inputs: FusionInputs, single: bool = False
    ) -> None:
        """Validate models and inputs; ``single``: one model to compress (retargetable
        methods only; they do not override this)."""
        for index, model in enumerate(models):
            if not isinstance(model, LeveledModel):
                raise TypeError(
                    f"{self.name}: model {index} is a {type(model).__name__}, expected a "
                    "LeveledModel (see fedfuse.models)"
                )
        self.check_run(
            max(len(models), 2) if single else len(models), models[0].spec if models else None
        )
        self._check_models(models)
        check_inputs(self.name, models, inputs, required=self.requirements(), needs=self.needs())

    def _check_models(self, models: Sequence[LeveledModel]) -> None:
        """Raise ValueError naming the first model that cannot be fused with model 0: another
        spec (when ``same_spec``), or other inputs or classes (any method)."""
        first = models[0].spec
        for index, model in enumerate(models[1:], start=1):
            if self.same_spec and model.spec != first:
                raise ValueError(
                    f"{self.name}: model {index} has spec {model.spec.to_dict()}, "
                    f"model 0 has {first.to_dict()}"
                )
            shape, classes = tuple(model.spec.input_shape), model.spec.num_classes
            if (shape, classes) != (tuple(first.input_shape), first.num_classes):
                raise ValueError(
                    f"{self.name}: model {index} maps inputs of shape {shape} to {classes} "
                    f"classes, model 0 {tuple(first.input_shape)} to {first.num_classes}"
                )

    def cost_with_many_sites(self, num_models: int) -> str | None:
        """Why fusing ``num_models`` models takes this method much longer than the others of its
        kind (``auto`` skips such a candidate past its ``max_costly_sites``), or None."""
        return None

    # ------------------------------------------------------------------ declared needs
    def requirements(self) -> frozenset[str]:
        """The :class:`FusionInputs` fields this configured instance cannot fuse without:
        :attr:`requires` plus those its options make indispensable (e.g. ``class_counts`` for
        ``head_weights``). :meth:`fuse` raises, naming the field, when one is None."""
        return frozenset(self.requires)

    def needs(self) -> frozenset[str]:
        """Every :class:`FusionInputs` field this configured instance reads: its
        :meth:`requirements` plus the fields it uses when they are given (e.g. ``scores`` with
        ``use_scores``, falling back without them). Any other field may be None: the fused
        model is the same."""
        return self.requirements()

    @classmethod
    def option_constructors(cls) -> list[Any]:
        """The ``__init__`` s that declare the options, nearest first: along the MRO, every one
        that forwards ``**`` options to its parent's, then the first that does not (empty: the
        method takes no options)."""
        constructors = []
        for klass in cls.__mro__[:-1]:  # object's __init__ declares no options
            init = klass.__dict__.get("__init__")
            if init is None:
                continue
            constructors.append(init)
            if not forwards_options(init):
                break
        return constructors

    @classmethod
    def option_defaults(cls) -> dict[str, Any]:
        """The options (the keys a config may set) with their defaults: each constructor's own
        (:meth:`option_constructors`, nearest first), an option declared twice the nearest's."""
        defaults: dict[str, Any] = {}
        for init in cls.option_constructors():
            for parameter in declared_options(init):
                defaults.setdefault(parameter.name, parameter.default)
        return defaults

    @classmethod
    def accepted_options(cls) -> list[str]:
        """Names of the constructor's options."""
        return list(cls.option_defaults())

    def options(self) -> dict[str, Any]:
        """The options this instance was built with (for result files)."""
        return {
            name: getattr(self, name) for name in self.accepted_options() if hasattr(self, name)
        }

    # ------------------------------------------------------------------ typed configs
    @classmethod
    def config_class(cls) -> type:
        """A frozen dataclass, ``<Class>Config``, whose fields are exactly the constructor's
        options with their type hints and defaults (built once per class). Its instances check
        their values' types as :func:`make_fusion_method` does, and pickle."""
        return config_class_of(cls)

    @classmethod
    def from_config(cls, config: Any) -> FusionMethod:
        """An instance with the options of ``config``: an instance of :meth:`config_class`, or
        a mapping of options (unknown options and wrong types are errors naming them)."""
        expected = cls.config_class()
        if isinstance(config, Mapping):
            check_options(cls, dict(config))
            config = expected(**config)
        if not isinstance(config, expected):
            raise TypeError(
                f"{cls.name}: from_config takes a {expected.__name__} or a mapping of options, "
                f"got {type(config).__name__}"
            )
        return cls(**config_values(config))

    def config(self) -> Any:
        """This instance's options as its :meth:`config_class` (``from_config`` inverts it)."""
        return type(self).config_class()(**self.options())


#: how a missing :class:`FusionInputs` field reads in an error message (in fedfuse's own app)
INPUT_NEEDS = {
    "data": "a fusion set on the server (run config fusion-data, or a simulated split)",
    "labels": "labels for the fusion set",
    "scores": "the sites' importance scores",
    "sample_counts": "the sites' sample counts",
    "class_counts": "the sites' class counts",
    "grams": "the sites' Gram matrices",
    "fisher": "the sites' Fisher information",
    "sites": "the sites themselves for statistics rounds (a Flower run, or LocalSites)",
    "site_scores": "the sites' scores of a model on their own labelled rows (Flower's "
    "evaluate message, or LocalSites with validation rows)",
}

#: the needs served by :attr:`FusionInputs.sites`: statistics rounds, and the sites' scores of
#: a model. A runner gives a method the sites when it reads either (:func:`reads_sites`); only
#: ``"sites"`` asks them for statistics rounds (:mod:`fedfuse.federation.method_needs`)
SITE_NEEDS = frozenset({"sites", "site_scores"})


def reads_sites(needs: Iterable[str]) -> bool:
    """Whether a method that reads ``needs`` (its :meth:`FusionMethod.needs`) is given the
    sites themselves (:attr:`FusionInputs.sites`): for statistics rounds or their scores."""
    return not SITE_NEEDS.isdisjoint(needs)


def plain_model_adapter(
    models: Sequence[LeveledModel | nn.Module], inputs: FusionInputs
) -> ModelAdapter | None:
    """The registered :class:`~fedfuse.models.ModelAdapter` for ``models`` when they are plain
    ``nn.Module`` s of one class (None when they are all leveled models already); their input
    shape is the fusion set's, else the sites' (``LocalSites``), else the class's last adapted
    one (:func:`~fedfuse.models.adapter.known_input_shape`), else read off the model."""
    plain = [m for m in models if not isinstance(m, LeveledModel)]
    if not plain:
        return None
    classes = sorted({type(m).__name__ for m in models})
    if len(plain) != len(models) or len(classes) != 1:
        raise TypeError(
            f"models to fuse are of several classes {classes}; fuse models of one class"
        )
    if inputs.data is not None:
        shape = tuple(inputs.data.shape[1:])
    else:  # a method without a fusion set: the sites' data, or an earlier adapter, says it
        shape = (
            getattr(inputs.sites, "input_shape", None)
            or known_input_shape(type(plain[0]))
            or infer_input_shape(plain[0])
        )
    if shape is None:
        raise ValueError(
            f"cannot tell the input shape of the plain {classes[0]} models: give "
            f"FusionInputs.data (the fusion set), or adapt the class once with "
            f"ModelAdapter({classes[0]}, input_shape)"
        )
    return ModelAdapter.of(plain[0], shape).register()
