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
Memory: `window` tensors per cached unit and branch. Cost: 3 Gram matrices (K - 1 reductions over D, float64) once per
computed value, then one weighted sum F_K + X c per forecast (float32 accumulation).
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

    def fit(self, steps: list[float], values: list[torch.Tensor]) -> list[tuple | None]:
        """Per sample, what does not depend on the forecast step: (V, S^-1, A~, S^-1 V^T X^T F_K) of the kept modes,
        or None where no singular value passes rtol. Computed once per computed value (the Gram matrices are the
        K - 1 reductions over D; each forecast after it is one pass X c)."""
        last = values[-1]
        batch = last.shape[0] if last.ndim > 1 else 1
        snaps = torch.stack([v.reshape(batch, -1) for v in values], dim=1).double()  # [B, K, D]
        x, y = snaps[:, :-1], snaps[:, 1:]                                             # [B, K-1, D]
        gxx = x @ x.transpose(1, 2)                                                    # X^T X  [B, K-1, K-1]
        gxy = x @ y.transpose(1, 2)                                                    # X^T Y
        gxf = x @ snaps[:, -1].unsqueeze(2)                                            # X^T F_K [B, K-1, 1]
        # the [K-1, K-1] algebra runs on the host: tiny matrices, one copy per computed value (on CUDA), no device
        # kernel per mode
        gxx, gxy, gxf = gxx.cpu(), gxy.cpu(), gxf.cpu()
        return [self._modes(gxx[b], gxy[b], gxf[b]) for b in range(batch)]

    def extrapolate_fitted(self, fit: list[tuple | None], steps: list[float], values: list[torch.Tensor],
                           target: float) -> torch.Tensor:
        last = values[-1]
        batch = len(fit)
        h = (steps[-1] - steps[0]) / (len(steps) - 1)
        n = (target - steps[-1]) / h
        coef = torch.stack([self._coefficients(modes, n, len(values) - 1) for modes in fit])  # [B, K-1, 1], float64
        # F_K + X c as a weighted sum per sample, accumulated in float32 (at least; the values' dtype if wider): the
        # weights are solved in float64 above, the pass over the latent-sized values need not be (a float64 copy of X
        # is 2-4x the values' bytes, and float64 runs at a fraction of the rate on most GPUs)
        work = torch.promote_types(last.dtype, torch.float32)
        coef = coef.to(device=last.device, dtype=work)
        out = last.reshape(batch, -1).to(work, copy=True)                               # [B, D]
        for j, value in enumerate(values[:-1]):
            out.add_(value.reshape(batch, -1).to(work) * coef[:, j])                   # + c_j X_j
        return out.reshape(last.shape).to(last.dtype)

    def _modes(self, gxx: torch.Tensor, gxy: torch.Tensor, gxf: torch.Tensor) -> tuple | None:
        """(V, S^-1, A~ -> A~^n, S^-1 V^T X^T F_K) of the kept modes of one sample, None where none is kept."""
        evals, v = torch.linalg.eigh(gxx)                   # X^T X = V S^2 V^T, ascending
        sing = evals.clamp_min(0.0).sqrt()
        keep = sing > max(self.rtol * float(sing.max()), 1e-300)
        if self.rank:
            keep &= torch.arange(len(sing)) >= len(sing) - self.rank  # the largest `rank`
        if not bool(keep.any()):
            return None
        v, s_inv = v[:, keep], 1.0 / sing[keep]
        a = s_inv[:, None] * (v.T @ gxy @ v) * s_inv[None, :]  # A~ [r, r]
        return v, s_inv, FractionalPower(a), s_inv[:, None] * (v.T @ gxf)

    @staticmethod
    def _coefficients(modes: tuple | None, n: float, pairs: int) -> torch.Tensor:
        """c = V S^-1 (A~^n - I) S^-1 V^T X^T F_K for one sample ([K-1, 1]; zeros without a kept mode)."""
        if modes is None:
            return torch.zeros(pairs, 1, dtype=torch.float64)
        v, s_inv, power, projected = modes
        return v @ (s_inv[:, None] * ((power(n) - power.eye) @ projected))


class FractionalPower:
    """A -> A^n for real n >= 0, with everything that does not depend on n done once (a DMD fit serves every
    forecast step until the next computed value). Integer n: repeated products. Otherwise, where every eigenvalue of
    A - I lies inside the unit circle, the binomial series A^n = sum_k C(n, k) (A - I)^k (finite, so exact, for a
    polynomial trend, whose A - I is nilpotent; an eigendecomposition would fail on that defective A), stopped at the
    first term below 1e-15; elsewhere V diag(lambda^n) V^-1."""

    TERMS = 64

    def __init__(self, a: torch.Tensor):
        self.a = a
        self.eye = torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
        self.d = a - self.eye  # A - I, whose powers the binomial series sums
        self.series = float(torch.linalg.eigvals(self.d).abs().max()) < 1.0
        self._powers: list[tuple[torch.Tensor, float]] = []  # (A - I)^k and its largest |entry|, k = 1, 2, ...
        self._eig: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def __call__(self, n: float) -> torch.Tensor:
        if float(n).is_integer():
            return torch.linalg.matrix_power(self.a, int(n))
        if not self.series:
            if self._eig is None:
                lam, w = torch.linalg.eig(self.a)
                self._eig = lam, w, torch.linalg.inv(w)
            lam, w, w_inv = self._eig
            return (w @ torch.diag(lam ** n) @ w_inv).real
        out, coef = self.eye.clone(), 1.0
        for k in range(1, self.TERMS + 1):
            coef *= (n - k + 1) / k
            term, largest = self._power(k)
            out += coef * term
            if largest * abs(coef) < 1e-15:
                break
        return out

    def _power(self, k: int) -> tuple[torch.Tensor, float]:
        while len(self._powers) < k:
            prev = self._powers[-1][0] if self._powers else self.eye
            term = prev @ self.d
            self._powers.append((term, float(term.abs().max())))
        return self._powers[k - 1]


def matrix_power(a: torch.Tensor, n: float) -> torch.Tensor:
    """A^n for a real n >= 0 (FractionalPower, for one n)."""
    return FractionalPower(a)(n)
