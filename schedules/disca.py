"""DisCa-style learnable forecaster (arXiv 2602.05449): a lightweight network, trained with the backbone frozen,
that forecasts a skipped unit's cached output (a stack/block residual or a module output) from its cached history.

It is used through a Plan: the FORECAST cells of the plan are served by the predictor instead of the Taylor
extrapolation (`dcache.runtime.forecast`), so a DisCa plan and its Taylor twin differ only in how F cells are filled
and cost the same block FLOPs (plus the predictor's own, reported by `DisCaPredictor.flops_per_token`). Training lives
in `dcache.schedules.tuning.search.disca`; this file holds the network, its plan serialisation and the runtime
forecaster.

Inputs of one forecast of a cached tensor (shape [B, ..., C]) at step t, from the unit's Taylor table of order K
(d_0 = value at the last computed step s, d_k = k-th finite difference / step distance, `filled` valid rows):

    a      = t - s                                   (steps ahead)
    T_k    = d_k * a^k / k!   for k < filled, else 0 (the Taylor terms; sum_k T_k is the Taylor forecast)
    tau    = [sigma_t, sigma_s, a / N, t / N, filled > 1]   (sigma = scheduler timestep / 1000)

and the prediction, per token (no token mixing; C channels, H hidden):

    rho    = RMS(T_0) over tokens and channels, per sample          (scale invariance across steps)
    e      = MLP(tau)                                               (time embedding, E wide)
    base   = T_0 + sum_{k>=1} T_k * (1 + G_k(e))                    (per-channel gains on the Taylor terms)
    h      = SiLU(W_in [T_0, ..., T_K] / rho * (1 + S(e)) + B(e));  h = SiLU(W_mid h)
    y      = base + rho * W_out h

G and W_out start at zero, so an untrained predictor *is* the Taylor forecast of the same order, and training can
only move away from it where the calibration data says so. One such net per (unit, cached tensor).
"""

from __future__ import annotations

import base64
import hashlib
import math
from typing import Any, Sequence

import torch
from torch import nn

from dcache.runtime.forecast import Forecaster, register_forecaster
from dcache.plans.plan import Plan, PlanError

FORMAT_VERSION = 1
N_TIME_FEATURES = 5


def unit_name(key: Any) -> str:
    """The engine's unit key as a string: ("seg", 1) -> "seg1" (stack segments), 3 -> "u3" (block / module unit),
    (3, 1) -> "u3k1" (the second call of a shared module unit, Adapter.shared)."""
    if isinstance(key, tuple) and len(key) == 2 and key[0] == "seg":
        return f"seg{int(key[1])}"
    if isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, int) for k in key):
        return f"u{key[0]}k{key[1]}"
    if isinstance(key, int):
        return f"u{key}"
    raise ValueError(f"unit key {key!r} is not a stack segment or a unit index.")


def stream_name(key: Any, index: int) -> str:
    return f"{unit_name(key)}.{index}"


def sigma_of(timesteps: Sequence[float] | None, step: int, num_steps: int) -> float:
    """The noise level of `step` in [0, 1]: scheduler timesteps / 1000 (or / 1 when already in [0, 1])."""
    if timesteps and 0 <= step < len(timesteps):
        scale = 1000.0 if max(abs(t) for t in timesteps) > 1.5 else 1.0
        return float(timesteps[step]) / scale
    return 1.0 - step / max(num_steps, 1)


def time_features(step: int, last_step: int, filled: int, num_steps: int,
                  timesteps: Sequence[float] | None) -> list[float]:
    n = max(num_steps, 1)
    return [sigma_of(timesteps, step, n), sigma_of(timesteps, last_step, n), (step - last_step) / n, step / n,
            1.0 if filled > 1 else 0.0]


def taylor_terms(table: torch.Tensor, filled: int, ahead: float) -> torch.Tensor:
    """[K+1, *shape] table -> [K+1, *shape] float32 terms d_k * ahead^k / k! (rows k >= filled are zero)."""
    terms = torch.zeros(table.shape, dtype=torch.float32, device=table.device)
    for k in range(min(filled, table.shape[0])):
        terms[k] = table[k].float() * (ahead ** k / math.factorial(k))
    return terms


class StreamNet(nn.Module):
    """The predictor of one cached tensor of one unit (see the module docstring for the formula)."""

    def __init__(self, channels: int, order: int, hidden: int, time_dim: int):
        super().__init__()
        self.channels, self.order = channels, order
        self.time = nn.Sequential(nn.Linear(N_TIME_FEATURES, time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim),
                                  nn.SiLU())
        self.inp = nn.Linear((order + 1) * channels, hidden)
        self.film = nn.Linear(time_dim, 2 * hidden)
        self.mid = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, channels)
        self.gain = nn.Linear(time_dim, max(order, 1) * channels)
        for layer in (self.out, self.gain, self.film):  # start as the Taylor forecast (and an identity FiLM)
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, terms: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """terms [K+1, N, L, C] (float32), feats [N, N_TIME_FEATURES] -> forecast [N, L, C]."""
        k1, n, _, c = terms.shape
        rho = terms[0].pow(2).mean(dim=(-2, -1), keepdim=True).sqrt().clamp_min(1e-8)  # [N, 1, 1]
        e = self.time(feats)  # [N, E]
        base = terms[0]
        if k1 > 1:
            gains = self.gain(e).view(n, -1, 1, c)  # [N, K, 1, C]
            for k in range(1, k1):
                base = base + terms[k] * (1.0 + gains[:, k - 1])
        x = (terms / rho).permute(1, 2, 0, 3).reshape(n, -1, k1 * c)  # [N, L, (K+1) C]
        scale, shift = self.film(e).unsqueeze(1).chunk(2, dim=-1)  # [N, 1, H] each
        h = torch.nn.functional.silu(self.inp(x) * (1.0 + scale) + shift)
        h = torch.nn.functional.silu(self.mid(h))
        return base + rho * self.out(h)

    def flops_per_token(self) -> int:
        """Multiply-adds x 2 of the per-token layers (the time MLP runs once per sample, not counted)."""
        c, h = self.channels, self.inp.out_features
        return 2 * ((self.order + 1) * c * h + h * h + h * c) + 4 * self.order * c


def as_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, ..., C] -> [B, L, C] (a view when possible); [C] -> [1, 1, C]."""
    if x.dim() == 1:
        return x.reshape(1, 1, -1)
    return x.reshape(x.shape[0], -1, x.shape[-1])


class DisCaPredictor(nn.Module):
    """All stream nets of one model and plan layout, with the metadata that ties them to it."""

    def __init__(self, streams: dict[str, int], *, order: int = 1, hidden: int = 64, time_dim: int = 32,
                 layout: dict | None = None):
        super().__init__()
        if order < 1:
            raise ValueError(f"order={order}: the DisCa predictor reads the Taylor table of the unit, which needs "
                             f"order >= 1 (d_0 and d_1).")
        self.streams = dict(sorted(streams.items()))
        self.order, self.hidden, self.time_dim = order, hidden, time_dim
        self.layout = dict(layout or {})  # model_class, block_layout, granularity, units, probe/tail blocks
        self.nets = nn.ModuleDict({name.replace(".", "_"): StreamNet(c, order, hidden, time_dim)
                                   for name, c in self.streams.items()})

    def net(self, stream: str) -> StreamNet:
        net = self.nets[stream.replace(".", "_")] if stream.replace(".", "_") in self.nets else None
        if net is None:
            raise PlanError(f"the DisCa predictor has no net for cached tensor {stream!r} (it was trained for "
                            f"{sorted(self.streams)}); retrain it for this plan (dcache search --method disca).")
        return net

    def forward_stream(self, stream: str, terms: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        return self.net(stream)(terms, feats)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # ------------------------------------------------------------------------------------------------ files
    def to_extras(self, training: dict | None = None) -> dict:
        """The plan extras["forecaster"] spec: metadata + the weights as base64 safetensors (+ their sha256)."""
        from safetensors.torch import save

        state = {k: v.detach().float().cpu().contiguous() for k, v in self.state_dict().items()}
        blob = save(state, metadata={"format": "dcache.disca", "version": str(FORMAT_VERSION)})
        return {"name": "disca", "version": FORMAT_VERSION, **self.layout, "order": self.order,
                "hidden": self.hidden, "time_dim": self.time_dim, "streams": self.streams,
                "params": self.num_params(), "sha256": hashlib.sha256(blob).hexdigest(),
                "training": training or {}, "weights": base64.b64encode(blob).decode("ascii")}

    @classmethod
    def from_extras(cls, spec: dict, plan: Plan | None = None) -> "DisCaPredictor":
        """Rebuild a predictor from a plan's extras["forecaster"]; every defect raises PlanError with the fix."""
        from safetensors.torch import load

        fix = "retrain it for this plan (dcache search --method disca) or drop extras[\"forecaster\"]"
        if spec.get("version") != FORMAT_VERSION:
            raise PlanError(f"DisCa predictor format version {spec.get('version')!r}; this dcache reads "
                            f"{FORMAT_VERSION}. Upgrade dcache or {fix}.")
        missing = [k for k in ("order", "hidden", "time_dim", "streams", "sha256", "weights") if k not in spec]
        if missing:
            raise PlanError(f"the DisCa predictor in this plan lacks {missing}; the file is damaged, {fix}.")
        try:
            blob = base64.b64decode(spec["weights"], validate=True)
        except (ValueError, TypeError):
            raise PlanError(f"the DisCa predictor weights are not valid base64; the plan file is damaged, {fix}.") \
                from None
        if hashlib.sha256(blob).hexdigest() != spec["sha256"]:
            raise PlanError(f"the DisCa predictor weights do not match their sha256 ({spec['sha256'][:12]}...); the "
                            f"plan file is damaged or was edited, {fix}.")
        if plan is not None:
            for field in ("model_class", "block_layout", "granularity", "units"):
                if field in spec and spec[field] != getattr(plan, field):
                    raise PlanError(f"this DisCa predictor was trained for {field}={spec[field]!r} but the plan has "
                                    f"{getattr(plan, field)!r}; {fix}.")
            if plan.forecast_order != spec["order"]:
                raise PlanError(f"the DisCa predictor reads Taylor tables of order {spec['order']} but the plan keeps "
                                f"forecast_order={plan.forecast_order}; set the plan's forecast_order to "
                                f"{spec['order']} or {fix}.")
        layout = {k: spec[k] for k in ("model_class", "block_layout", "granularity", "units", "probe_blocks",
                                       "tail_blocks") if k in spec}
        _check_sizes(spec, blob, fix)
        try:
            model = cls({k: int(v) for k, v in spec["streams"].items()}, order=int(spec["order"]),
                        hidden=int(spec["hidden"]), time_dim=int(spec["time_dim"]), layout=layout)
            model.load_state_dict(load(blob), strict=True)
        except Exception as exc:  # safetensors' own errors included: whatever fails, the file is unusable
            raise PlanError(f"the DisCa predictor weights do not fit its own description ({str(exc)[:200]}); {fix}.") \
                from None
        return model.eval().requires_grad_(False)


# One stream net per cached tensor of the plan's units (hidden and encoder stream: at most 2 per unit); the largest
# DiTs cache < 200 blocks x 2 modules, so 1024 streams leave room, and building each net's shapes costs ~2 ms.
MAX_DISCA_STREAMS = 1024


def _check_sizes(spec: dict, blob: bytes, fix: str) -> None:
    """Every size in the spec, bounded before any allocation: order in 1..MAX_FORECAST_ORDER, positive ints, and
    the network they describe (built on the meta device: shapes only, no memory) has exactly the tensors of the
    weights blob, so what `from_extras` then allocates is the size of the weights the plan file carries."""
    from dcache.runtime.cache_state import MAX_FORECAST_ORDER
    from dcache.files.state_file import safetensors_header

    def size(v: Any) -> bool:
        return type(v) is int and v >= 1  # noqa: E721 - bool is not a size

    streams = spec["streams"]
    bad = [k for k in ("hidden", "time_dim") if not size(spec[k])]
    if not (size(spec["order"]) and spec["order"] <= MAX_FORECAST_ORDER):
        bad.insert(0, "order")
    if not isinstance(streams, dict) or not streams or not all(isinstance(k, str) and size(v)
                                                                for k, v in streams.items()):
        bad.append("streams")
    if bad:
        raise PlanError(f"the DisCa predictor's {bad} are invalid (order: an int in 1..{MAX_FORECAST_ORDER}; hidden, "
                        f"time_dim: ints >= 1; streams: {{name: channels >= 1}}); the plan file is damaged, {fix}.")
    if len(streams) > MAX_DISCA_STREAMS:
        raise PlanError(f"the DisCa predictor has {len(streams):,} streams, more than {MAX_DISCA_STREAMS} (one per "
                        f"cached tensor: at most 2 per unit); the plan file is damaged or was edited, {fix}.")
    weights = len(blob) // 4  # float32 count: every size is a matrix side, so none can exceed it
    if max(spec["hidden"], spec["time_dim"], *streams.values()) > weights:
        raise PlanError(f"the DisCa predictor weights do not fit its own description (hidden={spec['hidden']}, "
                        f"time_dim={spec['time_dim']}, channels up to {max(streams.values())}, but it carries "
                        f"{weights} weights); the plan file is damaged or was edited, {fix}.")
    header = safetensors_header(blob) or {}
    stored = {k: v.get("shape") for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)}
    with torch.device("meta"):  # tensors per stream net: its count bounds the streams by the weights carried
        per_net = len(StreamNet(1, spec["order"], 1, 1).state_dict())
    if len(streams) * per_net != len(stored):
        raise PlanError(f"the DisCa predictor weights do not fit its own description ({len(streams)} streams of "
                        f"{per_net} tensors each, but it carries {len(stored)} tensors); the plan file is damaged or "
                        f"was edited, {fix}.")
    with torch.device("meta"):
        shapes = {k: list(v.shape) for k, v in DisCaPredictor(streams, order=spec["order"], hidden=spec["hidden"],
                                                              time_dim=spec["time_dim"]).state_dict().items()}
    if stored != shapes:
        raise PlanError(f"the DisCa predictor weights do not fit its own description (order={spec['order']}, "
                        f"hidden={spec['hidden']}, time_dim={spec['time_dim']}, {len(streams)} streams: other tensor "
                        f"shapes than the weights it carries); the plan file is damaged or was edited, {fix}.")


class DisCaForecaster(Forecaster):
    """Serves a plan's FORECAST cells with a DisCaPredictor (float32 math, output in the cache's dtype).

    trainable=False (inference): no autograd. trainable=True (training through the engine): the forecasts carry
    gradients to the predictor's parameters whenever autograd is on.
    """

    name = "disca"

    def __init__(self, predictor: DisCaPredictor, spec: dict | None = None, *, trainable: bool = False):
        self.trainable = trainable
        self.predictor = predictor if trainable else predictor.eval().requires_grad_(False)
        self._spec = spec
        self.num_steps = 0
        self.timesteps: tuple[float, ...] | None = None
        self._device: torch.device | None = None

    def reset(self, generation) -> None:
        self.num_steps = generation.num_steps or 0
        self.timesteps = generation.timesteps

    def __call__(self, hist, step: int) -> list[torch.Tensor]:
        if hist.order < 1 or hist.tables is None:
            raise PlanError(f"DisCa forecasting needs Taylor tables (forecast_order >= 1), the unit {hist.key!r} "
                            f"has order {hist.order}; use a plan made by dcache search --method disca.")
        last = hist.last_step if hist.last_step is not None else step
        n = self.num_steps or (step + 1)
        feats = time_features(step, last, hist.filled, n, self.timesteps)
        out = []
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            for i, table in enumerate(hist.tables):
                net = self.predictor.net(stream_name(hist.key, i))
                if table.shape[-1] != net.channels:
                    raise PlanError(f"the DisCa predictor for {stream_name(hist.key, i)!r} expects {net.channels} "
                                    f"channels, the cache holds {table.shape[-1]}; the plan's predictor was trained "
                                    f"on another model, retrain it (dcache search --method disca).")
                if self._device != table.device:
                    self.predictor.to(table.device)
                    self._device = table.device
                terms = taylor_terms(table, hist.filled, float(step - last))  # [K+1, B, ..., C]
                k1, b = terms.shape[0], terms.shape[1]
                flat = terms.reshape(k1, b, -1, terms.shape[-1])
                f = torch.tensor([feats], dtype=torch.float32, device=table.device).expand(b, -1)
                y = net(flat, f).reshape(table.shape[1:])
                out.append(y.to(table.dtype))
        return out

    def to_extras(self) -> dict:
        return self._spec if self._spec is not None else self.predictor.to_extras()


def _load(spec: dict, plan: Plan) -> DisCaForecaster:
    return DisCaForecaster(DisCaPredictor.from_extras(spec, plan), spec)


register_forecaster("disca", _load)
