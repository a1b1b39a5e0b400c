"""Fit the L2P forecaster's table (dcache.schedules.forecasters.l2p) on calibration runs of a pipeline.

    from dcache.schedules.tuning.l2p_fit import fit_l2p
    runs = [lambda seed=seed: pipe(labels=[0, 1, 2], generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]
    spec = fit_l2p(pipe, runs, "keyframe", keyframes=(0, 0.25, 0.5, 0.75))
    dcache.apply(pipe, "keyframe", scope="call", keyframes=(0, 0.25, 0.5, 0.75), forecaster=spec)

1. The cadence: one generation (the first run) with the method in call scope gives, per branch, which steps compute
   and which forecast; a forecast at step t reads the last `window` computed steps s before it.
2. The trajectories: every run once uncached, through dcache with a schedule that computes every call and records
   the call's Delta = v - x (exactly what call scope caches) at every step of every branch (at least float32,
   on the CPU), kept as each branch's Gram matrix M[i, j] = <Delta(i), Delta(j)> over its steps (float64, steps x
   steps): every G and g of the fit is an entry of M, for any cadence (`delta_grams`).
3. For each (t, s) of the cadence, G and g summed over runs and branches and the ridge solution towards
   the Taylor weights of `order` (the formula in l2p.py).

Because step 2 does not depend on the cadence, a search over keyframe placements records the calibration runs once
(`delta_grams`) and fits every candidate placement from the Gram matrices (`l2p_statistics(..., grams=...)`): one
generation for its cadence, none for its statistics.

The runs should be the user's own kind of prompts and settings (steps, guidance), and never the inputs a quality
figure is then reported on. Cost: one generation with the method, one uncached generation per run, and the
trajectories of one run in host memory at a time (steps x branches x the latent's size, float32).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

import dcache
from dcache import Action, Schedule
from dcache.runtime.signal_providers import ProviderView, SignalProvider, register_signal
from dcache.schedules.forecasters.l2p import table_key
from dcache.schedules.forecasters.polynomial import lagrange_weights


def _record_delta(view: ProviderView) -> None:
    """After a computed call: the call's Delta = v - x, kept in its branch's list (the recorder holds the lists)."""
    deltas = view.memory.get("deltas")
    if deltas is None:
        deltas = view.memory["deltas"] = []
        view.schedule.trajectories.append(deltas)
    delta = (view.output - view.hidden).detach()
    deltas.append((view.step, delta.to(torch.promote_types(delta.dtype, torch.float32)).cpu()))
    return None


TRAJECTORY = register_signal(SignalProvider(
    "l2p_trajectory", _record_delta, phase="computed",
    doc="records the call's Delta = v - x after every computed call (fit_l2p's calibration runs; no value)"))


class _RecordEveryCall(Schedule):
    """Computes every call and keeps each branch's Delta trajectory (one list per branch, in first-call order)."""

    name = "l2p-recorder"
    granularity = "stack"
    signals = frozenset({TRAJECTORY})

    def __init__(self):
        self.trajectories: list[list[tuple[int, torch.Tensor]]] = []

    def decide(self, ctx):
        return Action.COMPUTE


WINDOW = 2  # computed values a forecast combines, by default (the digits sweep: forecasters_tuning_l2p.json)
# One trajectory: its steps, M[i, j] = <X(s_i), X(s_j)>, and what X is: "branch" (a branch's Delta) or "difference"
# (D = Delta_cond - Delta_uncond of split CFG, which cfg_difference=True forecasts)
Gram = tuple[list[int], torch.Tensor, str]

# The pulls towards Taylor that ridge="auto" tries, strongest first, down to plain least squares (0). On tiny-motion
# at CFG 5 the choice sat at the weakest of 10..0.01 in 5 of 6 searched plans; 0 scored higher on its tuning batch.
AUTO_RIDGES = (10.0, 1.0, 0.1, 0.01, 0.001, 0.0)


def fit_l2p(target: Any, runs: Sequence[Callable[[], Any]], method: str = "keyframe", *, window: int = WINDOW,
            order: int = 2, ridge: float | str = 10.0, progress: bool = True, **knobs: Any) -> dict:
    """The `forecaster=` spec {"name": "l2p", "window", "fitted_steps", "weights"} of `method` (with `knobs`, in call
    scope) fitted on `runs` (callables that each run one generation of `target`, a pipeline or transformer).

    window: computed values a forecast combines; order: the Taylor order the ridge pulls towards (and the fallback's
    order: pass the same `order` to the method); ridge: lambda in units of the mean squared norm of a history value
    (0: plain least squares). The defaults are the best of a sweep on the bundled digits model's tuning batch
    (window 2-4, ridge 0-10: benchmarks/results/forecasters_tuning_l2p.json), where every setting stayed below
    Taylor order 2 and a stronger pull towards it did best: evidence about that model only. ridge="auto" chooses it
    on the first run instead (choose_ridge: one more uncached and one cached generation per AUTO_RIDGES value)."""
    if isinstance(ridge, str) and ridge != "auto":
        raise ValueError(f"fit_l2p: ridge={ridge!r} must be a number >= 0 or 'auto' (chosen on the first run, which "
                         f"must then return its sample as a tensor).")
    statistics = l2p_statistics(target, runs, method, window=window, order=order, progress=progress, **knobs)
    if ridge == "auto":
        ridge = choose_ridge(target, runs[0], statistics, method, order=order, progress=progress, **knobs)[0]
    return solve_l2p(statistics, ridge)


def choose_ridge(target: Any, run: Callable[[], Any], statistics: dict, method: str = "keyframe", *,
                 ridges: Sequence[float] = AUTO_RIDGES, order: int = 2, progress: bool = True,
                 **knobs: Any) -> tuple[float, dict[float, float]]:
    """The ridge of `ridges` whose fitted table, served by `method` in call scope, keeps what `run` returns closest
    to its uncached result: (ridge, {ridge: error}), error = |sample - sample_uncached|^2 / |sample_uncached|^2 over
    the returned sample (a tensor, a list of tensors, or a pipeline output with `images` / `frames` tensors:
    output_type="pt"). A cached generation forecasts from its own drifted history, which the fit's least squares
    (one forecast from the uncached history: it always prefers the weakest pull) cannot see; the finished sample
    does. `run` must be deterministic (a seeded generator)."""
    if not ridges or any(r < 0 for r in ridges):
        raise ValueError(f"choose_ridge: ridges={tuple(ridges)!r} must be one or more numbers >= 0.")
    with torch.no_grad():
        reference = _sample(run())
        errors = {}
        for r in ridges:
            with dcache.apply(target, method, scope="call", order=order, forecaster=solve_l2p(statistics, r),
                              **knobs):
                sample = _sample(run())
            if sample.shape != reference.shape:
                raise ValueError(f"choose_ridge: the cached run returned {tuple(sample.shape)} values, the uncached "
                                 f"one {tuple(reference.shape)}: pass a run that returns the same sample each time.")
            errors[r] = float((sample - reference).square().sum()) / max(float(reference.square().sum()), 1e-30)
            if progress:
                print(f"fit_l2p: ridge {r:g}: relative squared error of the sample {errors[r]:.3e}", flush=True)
    return min(errors, key=errors.get), errors


def _sample(result: Any) -> torch.Tensor:
    """What a run returned, as one flat float64 tensor on the host."""
    for name in ("images", "frames"):
        if isinstance(getattr(result, name, None), torch.Tensor):
            result = getattr(result, name)
    if isinstance(result, (list, tuple)) and result and all(isinstance(t, torch.Tensor) for t in result):
        return torch.cat([t.detach().to("cpu", torch.float64).flatten() for t in result])
    if isinstance(result, torch.Tensor):
        return result.detach().to("cpu", torch.float64).flatten()
    raise ValueError(f"fit_l2p(ridge='auto') compares the sample a run returns with its uncached one, but the first "
                     f"run returned {type(result).__name__}: return a tensor (a pipeline called with "
                     f"output_type='pt', or its .images / .frames).")


def l2p_statistics(target: Any, runs: Sequence[Callable[[], Any]], method: str = "keyframe", *, window: int = WINDOW,
                   order: int = 2, progress: bool = True, grams: Sequence[Gram] | None = None,
                   **knobs: Any) -> dict:
    """Steps 1-2 of the fit: {"pairs": {key: (t, s)}, "sums": {key: (G, g)}, "difference_sums" (the same for the
    CFG difference; zero without split CFG), "num_steps", "window", "order"}, from
    which `solve_l2p` gives the table for any ridge (a sweep over lambda runs the pipeline once). `grams`: the
    trajectories' Gram matrices from `delta_grams` on the same runs (recorded once for several placements); without
    them the runs are recorded here."""
    if not runs:
        raise ValueError("fit_l2p needs at least one calibration run (a callable that runs one generation).")
    if window < 1 or order < 0:
        raise ValueError(f"fit_l2p: window={window} (>= 1), order={order} (>= 0).")
    pairs, num_steps = _cadence(target, runs[0], method, window, order, knobs)
    if grams is None:
        grams = delta_grams(target, runs, progress=progress, num_steps=knobs.get("num_steps"))
    sums = {kind: {key: (torch.zeros(len(s), len(s), dtype=torch.float64), torch.zeros(len(s), dtype=torch.float64))
                   for key, (_, s) in pairs.items()} for kind in ("branch", "difference")}
    for steps, gram_matrix, kind in grams:
        index = {step: i for i, step in enumerate(steps)}
        for key, (t, history) in pairs.items():
            if t not in index or any(s not in index for s in history):
                continue  # a branch that skipped one of these steps (e.g. CFG off for part of the generation)
            rows = [index[s] for s in history]
            gram, cross = sums[kind][key]
            gram += gram_matrix[rows][:, rows]
            cross += gram_matrix[rows, index[t]]
    return {"pairs": pairs, "sums": sums["branch"], "difference_sums": sums["difference"], "num_steps": num_steps,
            "window": window, "order": order}


GRAM_CHUNK = 1 << 16  # elements per row converted to float64 at a time: a video latent's trajectory stays float32


def delta_grams(target: Any, runs: Sequence[Callable[[], Any]], *, progress: bool = True,
                num_steps: int | None = None) -> list[Gram]:
    """Every run once uncached: per branch trajectory (its steps, M, "branch") with M[i, j] = <Delta(s_i),
    Delta(s_j)> summed over every element in float64 ([steps, steps]); with split CFG (two branches on the same
    steps, the conditional one first, as diffusers calls them) also (steps, M, "difference") of D = Delta_cond -
    Delta_uncond. All the L2P fit needs from the runs, for any cadence.
    num_steps: the generation's step count where `target` is a bare transformer (a pipeline tells dcache itself)."""
    out = []
    for index, run in enumerate(runs):
        recorder = _RecordEveryCall()
        with dcache.apply(target, recorder, scope="call", **({} if num_steps is None else {"num_steps": num_steps})):
            run()
        trajectories = [([step for step, _ in t], [delta.flatten() for _, delta in t]) for t in recorder.trajectories]
        for steps, deltas in trajectories:
            out.append((steps, _gram(deltas), "branch"))
        if len(trajectories) == 2 and trajectories[0][0] == trajectories[1][0]:
            (steps, cond), (_, uncond) = trajectories
            if all(c.shape == u.shape for c, u in zip(cond, uncond)):
                out.append((steps, _gram([c - u for c, u in zip(cond, uncond)]), "difference"))
        if progress:
            print(f"fit_l2p: calibration run {index + 1}/{len(runs)}", flush=True)
    return out


def _gram(values: list[torch.Tensor]) -> torch.Tensor:
    """M[i, j] = <values[i], values[j]> in float64 ([steps, steps]), GRAM_CHUNK elements of each at a time."""
    gram = torch.zeros(len(values), len(values), dtype=torch.float64)
    for start in range(0, values[0].numel(), GRAM_CHUNK):
        chunk = torch.stack([v[start:start + GRAM_CHUNK] for v in values]).double()  # [steps, chunk]
        gram += chunk @ chunk.T
    return gram


def solve_l2p(statistics: dict, ridge: float = 0.1) -> dict:
    """Step 3: the ridge solution for every (t, s) the runs recorded -> the forecaster spec."""
    if ridge < 0:
        raise ValueError(f"fit_l2p: ridge={ridge} must be >= 0 (0: plain least squares).")
    tables = {}
    for table, sums in (("weights", statistics["sums"]), ("difference_weights", statistics.get("difference_sums"))):
        weights = tables[table] = {}
        for key, (t, steps) in statistics["pairs"].items():
            gram, cross = sums[key] if sums else (None, None)
            if gram is None or not torch.any(gram):
                continue  # no run recorded these steps (no split CFG: no difference table)
            prior = torch.tensor(_taylor_weights(steps, t, statistics["order"]), dtype=torch.float64)
            scale = ridge * float(torch.trace(gram)) / len(steps)
            solution = torch.linalg.lstsq(gram + scale * torch.eye(len(steps), dtype=torch.float64),
                                          (cross + scale * prior).unsqueeze(1)).solution.squeeze(1)
            weights[key] = [float(w) for w in solution]
    spec = {"name": "l2p", "window": statistics["window"], "fitted_steps": statistics["num_steps"],
            "weights": tables["weights"]}
    if tables["difference_weights"]:
        spec["difference_weights"] = tables["difference_weights"]
    return spec


def _taylor_weights(steps: list[int], t: int, order: int) -> list[float]:
    """The Taylor forecast of `order` through the last order + 1 values as weights over all of `steps` (Lagrange
    extrapolation; zero on the older ones)."""
    used = steps[-(order + 1):]
    return [0.0] * (len(steps) - len(used)) + lagrange_weights([float(s) for s in used], float(t))


def _cadence(target: Any, run: Callable[[], Any], method: str, window: int, order: int,
             knobs: dict) -> tuple[dict[str, tuple[int, list[int]]], int]:
    """{key: (t, s_1..s_K)} of every forecast the method serves in one generation (call scope), and its step count."""
    with dcache.apply(target, method, scope="call", order=order, **knobs) as handle:
        run()
        record = handle.engine.record
    if record is None or not record.calls or not record.num_steps:
        raise ValueError(f"fit_l2p: the run produced no generation with a known step count through {method!r}; pass "
                         f"runs that call the pipeline (or, for a bare transformer, apply with num_steps).")
    pairs: dict[str, tuple[int, list[int]]] = {}
    computed: dict[str, list[int]] = {}
    for call in record.calls:
        action, before = call.actions[0], computed.get(call.branch)
        # every forecast, and every computed call after the first: cfg_difference checks its forecasts there
        if action in "CF" and before:
            pairs[table_key(call.step, before[-window:])] = (call.step, before[-window:])
        if action == "C":
            computed.setdefault(call.branch, []).append(call.step)
    if not pairs:
        raise ValueError(f"fit_l2p: {method!r} with {knobs} forecast no call in call scope; L2P serves FORECAST "
                         f"actions (e.g. keyframe, or fixed_interval / taylorseer with order >= 1).")
    return pairs, int(record.num_steps)
