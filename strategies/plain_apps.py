"""What a plain Flower ClientApp can give the strategy, settled before any site trains.

A plain ClientApp (Flower's templates) replies with its model's weights and ``num-examples``,
plus the extras of :func:`fedfuse.clients.add_fusion_extras` when it calls it, and answers
statistics rounds when its query handler calls :func:`fedfuse.clients.answer_statistics`. Here
the app's
model is traced once (:class:`~fedfuse.models.ModelAdapter`), the extras to ask for are chosen
from the methods, and every method those sites cannot serve is refused at once
(:class:`~.preflight.MethodsUnfit`), apart from the strategy that then uses the result.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from torch import nn

from fedfuse.federation.plain_site import EXTRA_FIELDS, extras_for
from fedfuse.fusion import FusionMethod
from fedfuse.models import ModelAdapter
from fedfuse.models.adapter import check_factory

from .preflight import MethodsUnfit, check_methods
from .replies import EXTRAS_HINT

#: how a plain ClientApp answers statistics rounds
STATISTICS_HINT = (
    'add a handler `@app.query("statistics")` to the ClientApp that returns '
    "`fedfuse.clients.answer_statistics(msg, context, Net, trainloader)`"
)

#: how a missing input reads to a plain app's author: the strategy's argument that gives it
PLAIN_APP_NEEDS = {
    "data": "a fusion set on the server (OneShotFusion(fusion_set=...): your samples as a "
    "tensor, an (inputs, labels) pair or a DataLoader)",
    "labels": "labels for the fusion set (fusion_set= as an (inputs, labels) pair or a "
    "DataLoader of both)",
    "sites": "the sites themselves for statistics rounds (a ClientApp that answers them, "
    "and client_statistics=True)",
}


@dataclass
class PlainApp:
    """A plain ClientApp as the strategy sees it."""

    adapter: ModelAdapter
    #: the extras the sites are asked for (empty without ``client_extras``)
    extras: list[str]
    #: the :class:`FusionInputs` fields this run provides
    available_inputs: set[str]


def plain_app(
    model_fn: Callable[[], nn.Module],
    methods: Sequence[FusionMethod],
    *,
    input_shape: Sequence[int] | None,
    fixed_fusion_set: tuple | None,
    has_fusion_set: bool,
    client_extras: bool,
    available: Iterable[str] | None,
    min_nodes: int,
    client_statistics: bool = False,
) -> PlainApp:
    """Trace the app's model and refuse, now, every method the plain sites cannot serve.

    Args:
        fixed_fusion_set: the server's own ``(inputs, labels)``, whose inputs give the shape
            when ``input_shape`` is None.
        has_fusion_set: the server has a fusion set of any kind (the data and labels inputs).
        available: the inputs the run provides (None: what the plain sites send, the fusion
            set's data and labels when there is one, and the sites themselves with
            ``client_statistics``).
        client_statistics: the ClientApp answers statistics rounds
            (:func:`fedfuse.clients.answer_statistics`).

    Raises:
        MethodsUnfit: when a method needs what the sites will not send.
        ValueError: when there is no input shape to trace the model with.
        TypeError: when ``model_fn`` is a model instance, not its class or a factory.
    """
    check_factory(model_fn, "model_fn")
    if input_shape is None:
        if fixed_fusion_set is None:
            raise ValueError(
                "OneShotFusion(model_fn=...) needs the model's input shape: give the fusion "
                "set (fusion_set=) or input_shape="
            )
        input_shape = tuple(fixed_fusion_set[0].shape[1:])
    adapter = ModelAdapter(model_fn, tuple(input_shape)).register()
    extras = extras_for(methods) if client_extras else []
    if available is None:
        available = {"sample_counts", *(EXTRA_FIELDS[name] for name in extras)}
        if has_fusion_set:
            available |= {"data", "labels"}
        if client_statistics:
            available.add("sites")
    available_inputs = set(available)
    hint = (
        f". A plain ClientApp sends its weights and num-examples; for importance scores, "
        f"class counts, Gram matrices and Fisher {EXTRAS_HINT} and pass client_extras=True; "
        f"for statistics rounds (kf-sites, hf-sites) {STATISTICS_HINT} and pass "
        "client_statistics=True"
    )
    check_methods(
        methods, min_nodes, adapter.spec, available_inputs, hint=hint, wording=PLAIN_APP_NEEDS
    )
    wider = [m.name for m in methods if m.chooses_widths]
    if wider:
        raise MethodsUnfit(
            f"{wider}: choose the fused widths, and a plain "
            f"{adapter.model_class.__name__} keeps the widths its class defines"
        )
    return PlainApp(adapter, extras, available_inputs)
