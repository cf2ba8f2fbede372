r"""Optimal transport between two sets of neurons: the plan and the map it induces (POT).

Given a ground cost :math:`C \in \mathbb{R}^{n \times m}` between ``n`` reference neurons and
``m`` neurons of another model, and marginals :math:`\mu \in \Delta_n, \nu \in \Delta_m` (uniform
or importance scores), :func:`transport_plan` solves the Kantorovich problem

.. math::
    P^\ast = \operatorname*{arg\,min}_{P \in U(\mu, \nu)} \langle P, C \rangle_F
    \quad\text{(exact EMD)} \qquad\text{or}\qquad
    P^\ast_\lambda = \operatorname*{arg\,min}_{P \in U(\mu, \nu)}
        \langle P, C / \max C \rangle_F - \lambda H(P) \quad\text{(Sinkhorn)},

    U(\mu, \nu) = \{P \in \mathbb{R}_{+}^{n \times m} : P \mathbf{1}_m = \mu,\;
        P^\top \mathbf{1}_n = \nu\},

with POT (Flamary et al., JMLR 2021): the network simplex (``ot.emd``) or log-stabilised
Sinkhorn. :func:`row_stochastic` turns a plan into the barycentric map
:math:`T = \operatorname{diag}(P^\ast \mathbf{1})^{-1} P^\ast` (rows = reference neurons) that
OTFusion applies to a model's neurons, level by level
(:mod:`fedfuse.fusion.methods.matching.otfusion`) or feature space by feature space
(:func:`fedfuse.fusion.blocks.space_alignment.block_transport`).
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import torch

log = logging.getLogger(__name__)

SOLVERS = ("emd", "sinkhorn")


def transport_plan(
    cost: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    solver: str = "emd",
    reg: float = 0.01,
    max_iter: int = 1000,
) -> torch.Tensor:
    r"""The optimal transport plan between marginals ``a`` and ``b`` for ground cost ``cost``.

    Solves :math:`\min_{P \ge 0,\, P\mathbf{1} = a,\, P^\top\mathbf{1} = b} \langle P, C\rangle`
    exactly (``solver="emd"``, POT's network simplex) or with entropic regularisation ``reg``
    relative to :math:`\max C` (``"sinkhorn"``, log-stabilised Sinkhorn, at most ``max_iter``
    iterations).

    Args:
        cost: ``(n, m)`` ground cost.
        a, b: non-negative marginals of length ``n`` and ``m`` (default uniform); each is
            normalised to sum to 1.
        solver: ``"emd"`` or ``"sinkhorn"``.
        reg: Sinkhorn's entropic regularisation, relative to the cost's maximum.
        max_iter: Sinkhorn's iteration cap.

    Returns:
        ``P`` of shape ``(n, m)``, float64 on the CPU.
    """
    if solver not in SOLVERS:
        raise ValueError(f"solver must be one of {SOLVERS}, got {solver!r}")
    # imported here: POT pulls in scikit-learn, over a second at every start of a process that
    # never transports (each Flower ClientApp, every CLI command)
    import ot

    c = cost.detach().double().cpu().numpy()
    n, m = c.shape
    mu = _marginal(a, n)
    nu = _marginal(b, m)
    if solver == "emd":
        plan, info = ot.emd(mu, nu, c, numItermax=max(100_000, 20 * n * m), log=True)
        if info.get("warning"):
            log.warning("OTFusion: exact OT did not converge: %s", info["warning"])
    else:
        if reg <= 0:
            raise ValueError(f"Sinkhorn needs reg > 0, got {reg}")
        scale = float(c.max()) or 1.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence is checked below
            plan = ot.sinkhorn(
                mu,
                nu,
                c / scale,
                reg,
                method="sinkhorn_stabilized",
                numItermax=max_iter,
                stopThr=1e-9,
            )
        error = float(np.abs(plan.sum(0) - nu).sum() + np.abs(plan.sum(1) - mu).sum())
        if error > 1e-3:
            log.warning(
                "OTFusion: Sinkhorn (reg %g) is %.2g from the marginals after %d iterations",
                reg,
                error,
                max_iter,
            )
    return torch.from_numpy(np.ascontiguousarray(plan))


def _marginal(values: torch.Tensor | None, size: int) -> np.ndarray:
    if values is None:
        return np.full(size, 1.0 / size)
    v = values.detach().double().cpu().numpy().reshape(-1)
    if len(v) != size or (v < 0).any() or not np.isfinite(v).all() or v.sum() <= 0:
        raise ValueError(
            f"a marginal must be {size} finite non-negative values with a positive sum"
        )
    return v / v.sum()


def row_stochastic(plan: torch.Tensor, cost: torch.Tensor) -> torch.Tensor:
    r"""The barycentric map ``diag(P 1)^{-1} P`` of a plan ``P`` (``(n, m)``, rows summing to 1).

    For EMD :math:`P\mathbf{1} = \mu`; dividing by the actual row sums makes Sinkhorn's plan
    exactly row-stochastic too. A row without mass (a zero-score reference neuron) takes the
    model's neuron of least ``cost``.
    """
    mass = plan.sum(1, keepdim=True)
    empty = mass[:, 0] <= 0
    result = plan / mass.clamp_min(torch.finfo(plan.dtype).tiny)
    if empty.any():
        nearest = cost.to(plan.dtype)[empty].argmin(1)
        result[empty] = torch.nn.functional.one_hot(nearest, plan.shape[1]).to(plan.dtype)
    return result
