"""Weights of the linear extrapolators: F(t) ~ sum_k w_k F(s_k), with w computed from the steps only (scalars,
float64), so a forecast is one weighted sum of the cached tensors whatever their size.

    lagrange_weights(steps, t)        the interpolating polynomial through all points, evaluated at t
                                      (exact for F a polynomial of degree <= len(steps) - 1, any spacing)
    slope_weights(steps, t)           its derivative dF/dt at t
    chebyshev_ridge_weights(...)      a least-squares fit of a Chebyshev series of degree M (ridge-penalised)
"""

from __future__ import annotations

import torch


def lagrange_weights(steps: list[float], t: float) -> list[float]:
    """l_k(t) = prod_{j != k} (t - s_j) / (s_k - s_j)."""
    out = []
    for k, sk in enumerate(steps):
        w = 1.0
        for j, sj in enumerate(steps):
            if j != k:
                w *= (t - sj) / (sk - sj)
        out.append(w)
    return out


def slope_weights(steps: list[float], t: float) -> list[float]:
    """l_k'(t) = sum_{m != k} 1/(s_k - s_m) prod_{j != k, m} (t - s_j)/(s_k - s_j)."""
    out = []
    for k, sk in enumerate(steps):
        total = 0.0
        for m, sm in enumerate(steps):
            if m == k:
                continue
            term = 1.0 / (sk - sm)
            for j, sj in enumerate(steps):
                if j != k and j != m:
                    term *= (t - sj) / (sk - sj)
            total += term
        out.append(total)
    return out


def chebyshev_basis(x: torch.Tensor, degree: int) -> torch.Tensor:
    """[len(x), degree + 1]: T_0(x) = 1, T_1(x) = x, T_{m+1} = 2 x T_m - T_{m-1}."""
    cols = [torch.ones_like(x), x]
    while len(cols) < degree + 1:
        cols.append(2 * x * cols[-1] - cols[-2])
    return torch.stack(cols[:degree + 1], dim=1)


def chebyshev_ridge_weights(steps: list[float], t: float, degree: int, ridge: float,
                            span: tuple[float, float]) -> list[float]:
    """Ridge regression of a Chebyshev series on the history, evaluated at t, as weights over the history.

    x = 2 (s - lo) / (hi - lo) - 1 maps the step axis `span` = (lo, hi) onto [-1, 1]; Phi[k, m] = T_m(x_k);
    the coefficients c = (Phi^T Phi + ridge * P)^-1 Phi^T F minimise |Phi c - F|^2 + ridge |c_{1..M}|^2 (P = I without
    the constant T_0, so the mean level is never shrunk), and F(t) ~ phi(x_t)^T c = w^T F with
        w = Phi (Phi^T Phi + ridge P)^-1 phi(x_t).
    The degree is capped at K - 1 (K points determine at most that many coefficients)."""
    lo, hi = span
    scale = (hi - lo) if hi > lo else 1.0
    x = torch.tensor([2.0 * (s - lo) / scale - 1.0 for s in [*steps, t]], dtype=torch.float64)
    degree = min(degree, len(steps) - 1)
    basis = chebyshev_basis(x, degree)  # [K + 1, M + 1]
    phi, at = basis[:-1], basis[-1]
    penalty = torch.eye(degree + 1, dtype=torch.float64) * ridge
    penalty[0, 0] = 0.0
    gram = phi.T @ phi + penalty
    return (phi @ torch.linalg.lstsq(gram, at.unsqueeze(1)).solution).squeeze(1).tolist()
