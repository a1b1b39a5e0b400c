"""DMD: dynamic mode decomposition of the computed history, advanced to the forecast step.

Reference: Schmid, "Dynamic mode decomposition of numerical and experimental data" (J. Fluid Mech. 2010); exact DMD:
Tu et al., https://arxiv.org/abs/1312.0041. cache-dit ships it as a calibrator for its block caches
(`DMDCalibratorConfig`).

The last K computed values of a unit are snapshots of one sample's feature vector (flattened, per sample of the
batch: [D] each). DMD finds the linear map A with F(s_{j+1}) ~ A F(s_j) on the span of the snapshots and advances the
last value by it, so it extrapolates sums of exponentials and damped oscillations (a Taylor series only
polynomials). With X = [F_1 .. F_{K-1}], Y = [F_2 .. F_K] ([D, K-1] per sample) and the thin SVD X = U S V^T (rank r:
singular values above rtol * s_max, at most `rank`):
    A~       = U^T A U = S^-1 V^T (X^T Y) V S^-1                        [r, r]
    F(t)     = F_K + U (A~^n - I) U^T F_K,   n = (t - s_K) / h          (h: the mean step between snapshots)
Everything is computed from the Gram matrices X^T X, X^T Y, X^T F_K ([K-1, K-1] per sample, float64), since
U = X V S^-1:  F(t) = F_K + X c,  c = V S^-1 (A~^n - I) S^-1 V^T X^T F_K. The part of F_K outside the snapshots' span
is kept as it is (reuse). A~^n for a fractional n: the binomial series of (I + (A~ - I))^n where it converges
(exact for polynomial trends), else the eigendecomposition (real part).

Exact when the snapshots follow linear dynamics F_{j+1} = A F_j on an invariant subspace of dimension
r <= K - 1 sampled at a uniform step (e.g. a + b e^{lambda s}, or a rotation); with uneven gaps (keyframes) h is
their mean, an approximation.

When it helps: features that relax exponentially towards a level or oscillate (late denoising steps), at fixed
cadences; less with uneven keyframes.
Memory: `window` tensors per cached unit and branch; cost per forecast: 3 Gram matrices (K-1 reductions over D).
"""

from __future__ import annotations

from typing import ClassVar

import torch

from .base import HistoryForecaster, Knob


class DMDForecaster(HistoryForecaster):
    name = "dmd"
    min_samples = 3
    knobs: ClassVar[dict[str, Knob]] = {
        "window": Knob(4, 3, 16, "K: computed values per unit (K - 1 snapshot pairs)"),
        "rank": Knob(0, 0, 16, "r: most modes kept (0 = every mode above rtol)"),
        "rtol": Knob(1e-6, 0.0, 1.0, "singular values below rtol * the largest are dropped (conditioning)"),
    }

    def extrapolate(self, steps: list[float], values: list[torch.Tensor], target: float) -> torch.Tensor:
        last = values[-1]
        batch = last.shape[0] if last.ndim > 1 else 1
        snaps = torch.stack([v.reshape(batch, -1) for v in values], dim=1).double()  # [B, K, D]
        x, y = snaps[:, :-1], snaps[:, 1:]                                             # [B, K-1, D]
        gxx = x @ x.transpose(1, 2)                                                    # X^T X  [B, K-1, K-1]
        gxy = x @ y.transpose(1, 2)                                                    # X^T Y
        gxf = x @ snaps[:, -1].unsqueeze(2)                                            # X^T F_K [B, K-1, 1]
        h = (steps[-1] - steps[0]) / (len(steps) - 1)
        n = (target - steps[-1]) / h
        coef = torch.stack([self._coefficients(gxx[b], gxy[b], gxf[b], n) for b in range(batch)])  # [B, K-1, 1]
        step_out = (coef.transpose(1, 2) @ x).reshape(last.shape)                     # X c
        return (last.double() + step_out).to(last.dtype)

    def _coefficients(self, gxx: torch.Tensor, gxy: torch.Tensor, gxf: torch.Tensor, n: float) -> torch.Tensor:
        """c = V S^-1 (A~^n - I) S^-1 V^T X^T F_K for one sample ([K-1, 1])."""
        evals, v = torch.linalg.eigh(gxx)                   # X^T X = V S^2 V^T, ascending
        sing = evals.clamp_min(0.0).sqrt()
        keep = sing > max(self.rtol * float(sing.max()), 1e-300)
        if self.rank:
            keep &= torch.arange(len(sing)) >= len(sing) - self.rank  # the largest `rank`
        if not bool(keep.any()):
            return torch.zeros_like(gxf)
        v, s_inv = v[:, keep], 1.0 / sing[keep]
        a = s_inv[:, None] * (v.T @ gxy @ v) * s_inv[None, :]  # A~ [r, r]
        eye = torch.eye(len(s_inv), dtype=a.dtype)
        return v @ (s_inv[:, None] * ((matrix_power(a, n) - eye) @ (s_inv[:, None] * (v.T @ gxf))))


def matrix_power(a: torch.Tensor, n: float, terms: int = 64) -> torch.Tensor:
    """A^n for a real n >= 0. Integer n: repeated products. Otherwise, where every eigenvalue of A - I lies inside the
    unit circle, the binomial series A^n = sum_k C(n, k) (A - I)^k (finite, so exact, for a polynomial trend, whose
    A - I is nilpotent; an eigendecomposition would fail on that defective A); elsewhere V diag(lambda^n) V^-1."""
    if float(n).is_integer():
        return torch.linalg.matrix_power(a, int(n))
    eye = torch.eye(a.shape[0], dtype=a.dtype)
    d = a - eye
    if float(torch.linalg.eigvals(d).abs().max()) < 1.0:
        out, term, coef = eye.clone(), eye.clone(), 1.0
        for k in range(1, terms + 1):
            coef *= (n - k + 1) / k
            term = term @ d
            out += coef * term
            if float(term.abs().max()) * abs(coef) < 1e-15:
                break
        return out
    lam, w = torch.linalg.eig(a)
    return (w @ torch.diag(lam ** n) @ torch.linalg.inv(w)).real
