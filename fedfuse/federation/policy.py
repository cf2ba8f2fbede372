"""What a site agrees to send: its policy, set in its own SuperNode's node config.

The server chooses the run's methods and the statistics it asks for; a site's policy decides
which of those requests it answers. A hospital states it once, on its own machine::

    flower-supernode ... --node-config "partition-id=0 data-path='/data/site.npz'
        allow-methods='fedavg,kf-linear,kf-sites' allow-statistics='rounds'
        max-statistics-rounds=8 min-statistic-rows=200 refuse-grams-below-fan-in=true
        send-class-counts=false"

A run that asks for more than the policy allows is refused before the site trains, with the
reason; a statistics request outside it (more rounds than allowed, too few rows) is refused when
it arrives. The server names the site in ``results.json`` and goes on with the others while
``min-nodes`` still holds. Nothing here is Flower-specific: the ClientApp reads the node config
and calls these checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from fedfuse.federation.contract import SiteRefusal
from fedfuse.federation.upload_request import UploadRequest

#: the statistics a site can send: Gram matrices with its upload (RegMean), the answers to
#: statistics rounds (``kf-sites``, ``hf-sites``), its share of sums over sites that only
#: pass through secure aggregation (``secure-aggregation=true``: the server sees the sum), and
#: its Fisher information with its upload (Fisher merging, FedFisher), its class Gaussians
#: with its upload (a mean and a low-rank covariance of its inputs per class, when the run
#: completes its fusion set from them: :mod:`fedfuse.fusion.statistics.class_gaussians`), and
#: its scores of models the server sends (accuracy, loss and row count on its labelled rows:
#: ``auto`` ranks its candidates by them; a server that chooses the model learns, e.g., the
#: site's share of a class from a model that always predicts it)
STATISTICS_KINDS = ("grams", "rounds", "secure-sums", "fisher", "class-gaussians", "scores")

#: node-config key -> what it sets (the keys are listed in ``docs/deployment.md``)
POLICY_KEYS = {
    "allow-methods": "comma list of the fusion methods the site takes part in ('*': any)",
    "allow-statistics": "comma list of 'grams', 'rounds', 'secure-sums', 'fisher', "
    "'class-gaussians' and 'scores' the site sends ('none': none of them)",
    "max-statistics-rounds": "statistics rounds the site answers in one run",
    "min-statistic-rows": "samples of the site a statistic must sum over, at least",
    "refuse-grams-below-fan-in": "refuse a Gram with fewer rows than its columns (true/false)",
    "send-class-counts": "send the site's class counts with its upload (true/false)",
}

_POLICY_PREFIXES = ("allow-", "max-statistic", "min-statistic", "refuse-", "send-")


@dataclass(frozen=True)
class SitePolicy:
    """A site's limits on what it sends (the default allows everything, as before policies).

    Attributes:
        methods: the fusion methods the site takes part in (None: any).
        statistics: which of :data:`STATISTICS_KINDS` the site sends.
        max_statistics_rounds: statistics rounds answered per run (None: no limit); the
            site's scores of models (``"scores"``, :meth:`check_scores`) do not count.
        min_statistic_rows: a Gram or statistics reply must sum over at least this many of the
            site's samples.
        refuse_grams_below_fan_in: refuse a Gram whose design has fewer rows than columns (it
            then spans the individual rows; :mod:`docs/privacy.md`).
        send_class_counts: send the site's class counts (its case mix) with the upload.
    """

    methods: frozenset[str] | None = None
    statistics: frozenset[str] = frozenset(STATISTICS_KINDS)
    max_statistics_rounds: int | None = None
    min_statistic_rows: int = 0
    refuse_grams_below_fan_in: bool = False
    send_class_counts: bool = True

    @classmethod
    def from_node_config(
        cls, config: Mapping[str, Any], *, where: str = "node config"
    ) -> SitePolicy:
        """The policy a node config states; ValueError names a malformed or misspelt key."""
        stray = [
            key
            for key in config
            if str(key).startswith(_POLICY_PREFIXES) and str(key) not in POLICY_KEYS
        ]
        if stray:
            raise ValueError(
                f"{where}: unknown policy key(s) {sorted(stray)}; the keys are "
                f"{', '.join(POLICY_KEYS)}"
            )
        methods = _names(config.get("allow-methods", "*"))
        kinds = _names(config.get("allow-statistics", ",".join(STATISTICS_KINDS)))
        if kinds is None:
            kinds = frozenset(STATISTICS_KINDS)
        kinds = frozenset() if kinds == {"none"} else kinds
        unknown = sorted(kinds - set(STATISTICS_KINDS))
        if unknown:
            known = ", ".join(repr(kind) for kind in STATISTICS_KINDS)
            raise ValueError(f"{where}: allow-statistics names {unknown}; use {known} or 'none'")
        if methods is not None:
            _check_method_names(methods, where)
        rounds = config.get("max-statistics-rounds")
        return cls(
            methods=methods,
            statistics=kinds,
            max_statistics_rounds=None
            if rounds is None
            else _count(rounds, "max-statistics-rounds", where),
            min_statistic_rows=_count(
                config.get("min-statistic-rows", 0), "min-statistic-rows", where
            ),
            refuse_grams_below_fan_in=_flag(
                config.get("refuse-grams-below-fan-in", False), "refuse-grams-below-fan-in", where
            ),
            send_class_counts=_flag(
                config.get("send-class-counts", True), "send-class-counts", where
            ),
        )

    def describe(self) -> dict[str, Any]:
        """The policy as node-config values (for logs and the site's reply)."""
        return {
            "allow-methods": "*" if self.methods is None else ",".join(sorted(self.methods)),
            "allow-statistics": ",".join(sorted(self.statistics)) or "none",
            "max-statistics-rounds": self.max_statistics_rounds,
            "min-statistic-rows": self.min_statistic_rows,
            "refuse-grams-below-fan-in": self.refuse_grams_below_fan_in,
            "send-class-counts": self.send_class_counts,
        }

    def check_run(self, methods: Iterable[str], statistics: Iterable[str], samples: int) -> None:
        """Refuse a run that uses a method the site does not allow, asks for statistics it does
        not send, or asks statistics of fewer samples than it holds to be enough."""
        methods, statistics = list(methods), set(statistics)
        if self.methods is not None:
            barred = [m for m in methods if m not in self.methods]
            if barred:
                raise SiteRefusal(
                    f"site policy: the run's method(s) {barred} are not in allow-methods="
                    f"{','.join(sorted(self.methods))}"
                )
        barred = sorted(statistics - self.statistics)
        if barred:
            raise SiteRefusal(
                f"site policy: the run's methods ({', '.join(methods)}) need {barred}, not in "
                f"allow-statistics={','.join(sorted(self.statistics)) or 'none'}"
            )
        if statistics and samples < self.min_statistic_rows:
            raise SiteRefusal(
                f"site policy: the run asks for statistics and the site holds {samples} "
                f"samples, fewer than min-statistic-rows={self.min_statistic_rows}"
            )

    def check_request(self, methods: Iterable[str], request: UploadRequest, samples: int) -> None:
        """Refuse, before the site trains, a run of ``methods`` whose ``request`` (what the
        server's message asks the site to send) the policy does not allow (:meth:`check_run`)."""
        self.check_run(methods, request.statistics(), samples)

    def check_statistic(self, what: str, samples: int, rows: int, columns: int) -> None:
        """Refuse to send a statistic (``what``, e.g. "the Gram of level 2") that sums over
        fewer than ``min_statistic_rows`` samples, or, when the policy says so, whose design has
        fewer ``rows`` than ``columns``."""
        if samples < self.min_statistic_rows:
            raise SiteRefusal(
                f"site policy: {what} sums over {samples} samples, fewer than "
                f"min-statistic-rows={self.min_statistic_rows}"
            )
        if self.refuse_grams_below_fan_in and rows < columns:
            raise SiteRefusal(
                f"site policy: {what} has {rows} rows, fewer than its {columns} columns "
                "(refuse-grams-below-fan-in=true: it would span the site's rows)"
            )

    def check_round(self, kind: str, answered: int) -> None:
        """Refuse a statistics round when the site does not send ``kind`` or has answered
        ``answered`` rounds of this run already, as many as it allows."""
        if kind not in self.statistics:
            raise SiteRefusal(
                f"site policy: statistics {kind!r} are not in allow-statistics="
                f"{','.join(sorted(self.statistics)) or 'none'}"
            )
        if self.max_statistics_rounds is not None and answered >= self.max_statistics_rounds:
            raise SiteRefusal(
                f"site policy: max-statistics-rounds={self.max_statistics_rounds} answered "
                "already in this run"
            )

    def check_scores(self) -> None:
        """Refuse to score a model the server sends (a scoring round, Flower's federated
        evaluation) when the site does not send ``"scores"``; scoring rounds are not counted
        against ``max_statistics_rounds``."""
        if "scores" not in self.statistics:
            raise SiteRefusal(
                "site policy: scores of models are not in allow-statistics="
                f"{','.join(sorted(self.statistics)) or 'none'}"
            )


def _names(value: Any) -> frozenset[str] | None:
    names = frozenset(n.strip() for n in str(value).split(",") if n.strip())
    return None if names in (frozenset(), frozenset({"*"})) else names


def _check_method_names(names: frozenset[str], where: str) -> None:
    from fedfuse.fusion import FUSION_METHODS

    unknown = sorted(names - set(FUSION_METHODS))
    if unknown:
        raise ValueError(
            f"{where}: allow-methods names unknown method(s) {unknown}; known: "
            f"{', '.join(sorted(FUSION_METHODS))}"
        )


def _count(value: Any, key: str, where: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = -1
    if isinstance(value, bool) or number < 0 or str(number) != str(value).strip():
        raise ValueError(f"{where}: {key} must be a whole number >= 0, got {value!r}")
    return number


def _flag(value: Any, key: str, where: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise ValueError(f"{where}: {key} must be true or false, got {value!r}")
