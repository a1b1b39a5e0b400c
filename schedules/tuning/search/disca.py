"""Training of the DisCa-style learnable forecaster (see dcache.schedules.disca for the network), backbone frozen.

1. Record: the calibration runs go through the pipeline under an all-compute dcache schedule with the base plans'
   granularity (and probe/tail blocks) that *keeps* every unit's cache, so the residuals / module outputs read after
   each transformer call are exactly what a cached replay would store at a computed step. Besides the teacher
   (uncached) trajectory, `rollout` records each base plan's own trajectory with its skipped cells filled by the
   Taylor forecast (the drift the forecaster meets at inference), still recording the true values.
2. Samples: for every base plan, branch and unit, the unit's history is replayed through the engine's own
   `UnitHistory` (Taylor tables of the predictor's order, the same update code as at inference) over the plan's
   computed steps; at each skipped step the sample is (Taylor terms of the history, time features) -> the recorded
   value at that step.
3. Regression: relative MSE per cached tensor, summed, AdamW; minibatches come from a generator seeded by
   (seed, iteration), so a resumed run draws exactly what an uninterrupted one draws.
4. Closed loop (`online_iterations`): the residual MSE is not what the image sees (the output head weighs error
   directions differently, and errors that persist over steps add up while alternating ones cancel), so the
   predictor is then fine-tuned through the engine on the first-order error of the final sample (`online_loss`).
5. Export: each base plan becomes a DisCa plan: every non-computed cell becomes FORECAST, forecast_order = the
   predictor's order, and the predictor is stored in the plan's extras["forecaster"] (written atomically with the
   plan). `disca_search` also measures each plan's Taylor twin (same cells, no predictor): equal block FLOPs.

The state (weights, optimisers, iterations of both phases, data fingerprint) is written atomically to
`disca.ckpt.safetensors` (JSON + tensors, no pickle) every `checkpoint_every` regression iterations, after every
closed-loop iteration and when a run stops; `resume=True` continues from it and refuses a checkpoint made on other
data or another config.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from dcache.actions import Action, Granularity
from dcache.files.checks import is_count, same
from dcache.files.atomic import remove_stale_temporaries
from dcache.plans.plan import Plan
from dcache.files.state_file import StateFileError, load_state, refuse_legacy, save_state
from dcache.schedule import CallContext, Schedule
from dcache.runtime.cache_state import UnitHistory

from ..profiling import ProfileSession
from ...disca import DisCaPredictor, as_tokens, stream_name, taylor_terms, time_features
from .checkpoint_checks import FIX, check_adam, check_weights, damaged
from .core import (Calibration, FrontPoint, Template, first_output, make_template, measure, replace_first_output,
                   run_plan, write_front)

CHECKPOINT = "disca.ckpt.safetensors"  # dcache.files.state_file: JSON + tensors, never a pickle
LEGACY_CHECKPOINT = "disca.ckpt.pt"  # what older versions pickled; refused, never opened
STATE_KIND = "DisCa checkpoint"
ROLLOUTS = {"taylor": None, "reuse": lambda hist, step: hist.reuse()}


@dataclass(frozen=True)
class DisCaConfig:
    order: int = 1  # Taylor order of the history the predictor reads (the plan's forecast_order)
    hidden: int = 64  # hidden width of each per-tensor net
    time_dim: int = 32
    iterations: int = 0  # residual-regression warm start (off: on the tiny model it lost to the Taylor start)
    lr: float = 2e-3
    weight_decay: float = 1e-4
    batch: int = 64  # rows (one sample of one calibration image) per net per iteration
    seed: int = 0
    checkpoint_every: int = 25
    # Training data besides the teacher trajectory: the trajectories of each base plan replayed with its skipped
    # cells filled by "taylor" (Taylor forecast of `order`) or "reuse", recording the true values on them.
    rollout: tuple[str, ...] = ()
    # Closed loop through the engine (one calibration generation per iteration, the base plans in turn): loss on the
    # transformer output of every forecast call vs the uncached output on the same input. With iterations=0 it
    # starts from the Taylor forecast (the zero-initialised correction), the recipe that won on the tiny model.
    online_iterations: int = 40
    online_lr: float = 5e-4

    def __post_init__(self) -> None:
        bad = [r for r in self.rollout if r not in ROLLOUTS]
        if bad:
            raise ValueError(f"DisCaConfig.rollout={self.rollout}: {bad} not in {sorted(ROLLOUTS)} (the forecast that "
                             f"fills a base plan's skipped cells while recording its trajectory).")
        for name, lo in (("order", 1), ("hidden", 1), ("time_dim", 1), ("batch", 1), ("checkpoint_every", 1),
                         ("online_iterations", 0)):
            if getattr(self, name) < lo:
                raise ValueError(f"DisCaConfig.{name}={getattr(self, name)} must be >= {lo}.")
        if self.iterations < 0:
            raise ValueError(f"DisCaConfig.iterations={self.iterations} must be >= 0.")
        for name in ("lr", "online_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"DisCaConfig.{name}={getattr(self, name)} must be > 0.")

    def fingerprint_dict(self) -> dict:
        """What must match for a resume (iterations and checkpoint cadence may change)."""
        d = asdict(self)
        for name in ("iterations", "checkpoint_every", "online_iterations"):
            d.pop(name)
        return d


# ------------------------------------------------------------------------------------------------ recording
class _Record(Schedule):
    """All-compute, every unit cached: the engine stores what a replay of the base plan stores at computed steps."""

    name = "disca-record"
    segment_runs = False  # the predictor is trained per list, as a DisCa plan replays (Schedule.segment_runs)

    def __init__(self, granularity: Granularity, probe_blocks: int, tail_blocks: int):
        self.granularity = granularity
        self.probe_blocks, self.tail_blocks = probe_blocks, tail_blocks

    def decide(self, ctx: CallContext) -> Action:
        return Action.COMPUTE

    def may_reuse(self, branch: str, unit: int) -> bool:
        return True


# run index -> branch -> unit key -> step -> cached tensors (float32, CPU)
Recording = list[dict[str, dict[Any, dict[int, list[torch.Tensor]]]]]


def record_units(pipe: Any, runs: Sequence[Callable[[], Any]], base: Plan, *, student: Plan | None = None,
                 forecast: Callable[[UnitHistory, int], list[torch.Tensor]] | None = None,
                 order: int = 1) -> tuple[Recording, list]:
    """The true unit values (what the engine caches at a computed step) at every step of each run; also the
    scheduler timesteps per run.

    Without `student` the runs follow the uncached (teacher) trajectory. With `student` (a stack or block plan) they
    follow the student's trajectory: at the student's non-computed cells the unit's output is replaced by
    `input + forecast(history, step)` (default: the Taylor forecast of `order`), the history being the true values
    at the student's computed steps, exactly what a cached replay holds; the true values are still recorded. This is
    the data of the skipped steps as inference meets them (the drift of earlier forecasts included).
    """
    schedule = _Record(Granularity(base.granularity), base.probe_blocks, base.tail_blocks)
    recording: Recording = []
    timesteps: list = []
    replicas: dict[tuple[str, Any], UnitHistory] = {}
    with ProfileSession(pipe, schedule=schedule) as session:
        columns = _student_hooks(session, student, replicas, forecast, order) if student is not None else {}

        def grab(where, output):
            bstate = session.engine.branches.get(where.branch)
            if bstate is None:
                return
            run = recording[-1].setdefault(where.branch, {})
            row = student._rows_for(where.branch)[where.step] if student is not None else None
            for key, hist in bstate.units.items():
                if hist.tables is not None:
                    values = [t.detach().float().cpu().clone() for t in hist.reuse()]
                    run.setdefault(key, {})[where.step] = values
                    replica = replicas.get((where.branch, key))
                    if row is not None and replica is not None and (
                            row[columns[key]] == Action.COMPUTE.value or replica.tables is None):
                        replica.update([t.detach().clone() for t in hist.reuse()], where.step)

        session.on_output(grab)
        for fn in runs:
            recording.append({})
            replicas.clear()
            with torch.no_grad():
                fn()
            rec = session.engine.record
            timesteps.append(rec.timesteps if rec is not None else None)
    return recording, timesteps


def _student_hooks(session: ProfileSession, student: Plan, replicas: dict, forecast, order: int) -> dict[Any, int]:
    """Torch hooks that replace unit outputs at the student's skipped cells; returns unit key -> action column."""
    from dcache.runtime.cache_ops import ops_for
    from dcache.schedule import GenerationInfo

    g = Granularity(student.granularity)
    if g is Granularity.MODULE:
        raise ValueError("rollout (student-trajectory) data is implemented for stack and block plans; train module "
                         "plans on the teacher trajectory (rollout=()).")
    spans: list[tuple[Any, int, Any, Any]] = []  # (key, column, first slot, last slot)
    for slot in session.engine.blocks:
        if g is Granularity.BLOCK:
            spans.append((slot.index, slot.index, slot, slot))
        elif slot.role == "middle" and slot.segment_first:
            last = next(s for s in session.engine.blocks if s.list_index == slot.list_index and s.segment_last)
            spans.append((("seg", slot.list_index), 0, slot, last))
    inputs: dict[Any, tuple] = {}
    state = {"generation": None}

    def predict(hist: UnitHistory, step: int) -> list[torch.Tensor]:
        if forecast is None:
            return hist.forecast(step)
        reset = getattr(forecast, "reset", None)
        gen = session.engine.generations
        if reset is not None and state["generation"] != gen:
            rec = session.engine.record
            reset(GenerationInfo(num_steps=rec.num_steps, timesteps=rec.timesteps, units=session.engine.units,
                                 model_class=type(session.engine.transformer).__name__,
                                 num_blocks=len(session.engine.blocks)))
            state["generation"] = gen
        return forecast(hist, step)

    for key, col, first, last in spans:
        def pre(module, args, kwargs, key=key, first=first):
            inputs[key] = first.slots.read(args, kwargs)
            return None

        def post(module, args, kwargs, output, key=key, col=col, last=last):
            where = session.where()
            if where is None:
                return None
            replica = replicas.setdefault((where.branch, key), UnitHistory(order))
            row = student._rows_for(where.branch)[where.step]
            if row[col] == Action.COMPUTE.value or replica.tables is None:
                return None
            h_in, e_in = inputs[key]
            cached = predict(replica, where.step)
            apply = ops_for(h_in).apply  # differentiable when grad is on (training through this rollout)
            out_h = apply(h_in, cached[0])
            out_e = apply(e_in, cached[1]) if e_in is not None and len(cached) > 1 else e_in
            return last.slots.make_output(out_h, out_e)

        session._torch_hooks.append(first.block.register_forward_pre_hook(pre, with_kwargs=True))
        session._torch_hooks.append(last.block.register_forward_hook(post, with_kwargs=True))
    return {key: col for key, col, _, _ in spans}


def _unit_keys(plan: Plan, recorded_keys: Sequence[Any]) -> dict[int, list[Any]]:
    """Action-row column -> the engine unit keys it drives (stack: every segment; block/module: the index)."""
    if Granularity(plan.granularity) is Granularity.STACK:
        return {0: sorted(k for k in recorded_keys if isinstance(k, tuple))}
    return {u: [u] for u in range(len(plan.units)) if u in recorded_keys}


@dataclass
class StreamData:
    terms: torch.Tensor  # [K+1, M, L, C] Taylor terms of the history (rows of all samples, all images)
    feats: torch.Tensor  # [M, N_TIME_FEATURES]
    target: torch.Tensor  # [M, L, C]

    @property
    def rows(self) -> int:
        return self.target.shape[0]


def build_samples(recording: Recording, timesteps: list, plans: Sequence[Plan], order: int) -> dict[str, StreamData]:
    """Per cached tensor (stream name): every (history, skipped step) of every plan, branch and run."""
    parts: dict[str, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
    for plan in plans:
        for run, ts in zip(recording, timesteps):
            for branch, units in run.items():
                rows = plan._rows_for(branch)
                n = len(rows)
                for col, keys in _unit_keys(plan, list(units)).items():
                    for key in keys:
                        steps = units[key]
                        hist = UnitHistory(order)
                        for s, row in enumerate(rows):
                            if s not in steps:
                                continue
                            if row[col] == Action.COMPUTE.value or hist.tables is None:
                                hist.update([t.clone() for t in steps[s]], s)
                                continue
                            ahead = float(s - hist.last_step)
                            feats = time_features(s, hist.last_step, hist.filled, n, ts)
                            for i, (table, target) in enumerate(zip(hist.tables, steps[s])):
                                terms = as_tokens_terms(taylor_terms(table, hist.filled, ahead))
                                y = as_tokens(target)
                                f = torch.tensor([feats], dtype=torch.float32).expand(y.shape[0], -1)
                                parts.setdefault(stream_name(key, i), []).append((terms, f, y))
    if not parts:
        raise ValueError("the base plans skip no step of any cached unit: there is nothing to forecast; pass plans "
                         "with reused/forecast cells (e.g. from dcache search --method lemica or dp).")
    return {name: StreamData(torch.cat([p[0] for p in ps], dim=1), torch.cat([p[1] for p in ps]),
                             torch.cat([p[2] for p in ps])) for name, ps in sorted(parts.items())}


def merge_samples(parts: Sequence[dict[str, StreamData]]) -> dict[str, StreamData]:
    names = sorted({n for p in parts for n in p})
    return {n: StreamData(torch.cat([p[n].terms for p in parts if n in p], dim=1),
                          torch.cat([p[n].feats for p in parts if n in p]),
                          torch.cat([p[n].target for p in parts if n in p])) for n in names}


def as_tokens_terms(terms: torch.Tensor) -> torch.Tensor:
    """[K+1, B, ..., C] -> [K+1, B, L, C]."""
    if terms.dim() == 2:
        return terms.reshape(terms.shape[0], 1, 1, -1)
    return terms.reshape(terms.shape[0], terms.shape[1], -1, terms.shape[-1])


def data_fingerprint(data: dict[str, StreamData], config: DisCaConfig) -> str:
    h = hashlib.sha256(repr(sorted(config.fingerprint_dict().items())).encode())
    for name, d in data.items():
        h.update(name.encode())
        for t in (d.terms, d.feats, d.target):
            h.update(repr(tuple(t.shape)).encode())
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()


# ------------------------------------------------------------------------------------------------ training
def _rel_mse(pred: torch.Tensor, target: torch.Tensor, denom: float) -> torch.Tensor:
    return (pred - target).pow(2).mean() / denom


def evaluate(model: DisCaPredictor, data: dict[str, StreamData], chunk: int = 256) -> dict[str, float]:
    """Relative MSE per stream over all rows (the untrained model gives the Taylor forecast's error)."""
    out = {}
    with torch.no_grad():
        for name, d in data.items():
            err = 0.0
            for i in range(0, d.rows, chunk):
                sl = slice(i, i + chunk)
                err += float((model.forward_stream(name, d.terms[:, sl], d.feats[sl]) - d.target[sl]).pow(2).sum())
            out[name] = err / max(float(d.target.pow(2).sum()), 1e-20)
    return out


def _save(path: Path, state: dict) -> None:
    save_state(path, state, STATE_KIND)


def _load(ckpt: Path) -> dict:
    """The checkpoint's state ({} when there is none); StateFileError naming the file for anything dcache did not
    write, a pickle of an older version (disca.ckpt.pt) included: never loaded."""
    refuse_legacy(ckpt.with_name(LEGACY_CHECKPOINT), STATE_KIND, FIX)
    if not ckpt.is_file():
        return {}
    state = load_state(ckpt, STATE_KIND, FIX)
    if not isinstance(state, dict):
        raise StateFileError(f"{str(ckpt)!r} does not hold a DisCa training state; it is damaged: {FIX}.")
    return state


def _check_phase(state: dict, ckpt: Path, model: DisCaPredictor, opt: torch.optim.Optimizer, counter: str,
                 optimizer: str) -> int:
    """The iteration count of one phase (`counter`) and, once it is past 0, the weights and that phase's optimizer
    state, checked against the running model: a damaged file names itself here, not in a raw torch error later."""
    done = state.get(counter, 0)
    if not is_count(done, 0):
        raise damaged(ckpt, STATE_KIND, f"{counter} {done!r} is not an int >= 0")
    if done:
        check_weights(state.get("model"), model, "model", ckpt, STATE_KIND)
        check_adam(state.get(optimizer), list(model.parameters()), opt.state_dict(), optimizer, ckpt, STATE_KIND)
    return done


def train_predictor(data: dict[str, StreamData], out_dir: str | os.PathLike, config: DisCaConfig = DisCaConfig(), *,
                    layout: dict | None = None, resume: bool = False, progress: bool = True,
                    stop_after: int | None = None) -> tuple[DisCaPredictor, dict]:
    """Train (or resume) the predictor on `data`; returns it (eval mode) and a summary (losses vs Taylor)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    streams = {name: d.target.shape[-1] for name, d in data.items()}
    torch.manual_seed(config.seed)  # weight init
    model = DisCaPredictor(streams, order=config.order, hidden=config.hidden, time_dim=config.time_dim,
                           layout=layout)
    opt = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay)
    fingerprint = data_fingerprint(data, config)
    start = 0
    if resume:
        remove_stale_temporaries(out)  # a run killed (kill -9) while writing a file left its temporary file
    state = _load(ckpt) if resume else {}
    if state:
        if not same(state.get("fingerprint"), fingerprint):
            raise ValueError(f"the DisCa checkpoint {ckpt} was trained on other calibration data, plans or config "
                             f"({str(state.get('config'))[:300]}); use a new output folder or resume=False to start "
                             f"over.")
        if "iteration" not in state:
            raise damaged(ckpt, STATE_KIND, "it has no 'iteration'")
        start = _check_phase(state, ckpt, model, opt, "iteration", "optimizer")
        if start:
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
    taylor = evaluate(DisCaPredictor(streams, order=config.order, hidden=config.hidden, time_dim=config.time_dim),
                      data)
    denom = {name: max(float(d.target.pow(2).mean()), 1e-20) for name, d in data.items()}
    names = sorted(data)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.iterations, initial=min(start, config.iterations), desc="disca predictor",
                   leave=False)
    model.train()
    done = saved = start
    grad_before = torch.is_grad_enabled()
    torch.set_grad_enabled(True)

    def save() -> None:
        _save(ckpt, {"model": model.state_dict(), "optimizer": opt.state_dict(), "iteration": done,
                     "fingerprint": fingerprint, "config": asdict(config)})

    try:
        for it in range(start, config.iterations):
            if stop_after is not None and it >= stop_after:
                break
            gen = torch.Generator().manual_seed(config.seed * 1_000_003 + it)
            opt.zero_grad()
            total = torch.zeros(())
            for name in names:
                d = data[name]
                idx = torch.randint(d.rows, (min(config.batch, d.rows),), generator=gen)
                pred = model.forward_stream(name, d.terms[:, idx], d.feats[idx])
                total = total + _rel_mse(pred, d.target[idx], denom[name])
            total.backward()
            opt.step()
            done = it + 1
            if done % config.checkpoint_every == 0 or done == config.iterations:
                save()
                saved = done
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{float(total.detach()) / len(names):.4g}")
    finally:
        torch.set_grad_enabled(grad_before)
        if done != saved or not ckpt.is_file():  # stopped or interrupted between checkpoints: keep what is done
            save()
        if bar is not None:
            bar.close()
    model.eval().requires_grad_(False)
    trained = evaluate(model, data)
    summary = {"iterations": done,
               "rows": {n: d.rows for n, d in data.items()},
               "rel_mse_taylor": taylor, "rel_mse_disca": trained, "params": model.num_params(),
               "config": asdict(config)}
    return model, summary


# ------------------------------------------------------------------------------------------------ plans
def forecast_rows(plan: Plan) -> dict[str, list[str]]:
    """Every non-computed cell of `plan` as FORECAST."""
    return {b: [row.replace(Action.REUSE.value, Action.FORECAST.value) for row in rows]
            for b, rows in plan.actions.items()}


def taylor_plan(base: Plan, order: int) -> Plan:
    """The base plan with Taylor forecasting of the given order in every non-computed cell (no predictor)."""
    extras = {k: v for k, v in base.extras.items() if k != "forecaster"}
    prov = {**base.provenance, "method": f"{base.provenance.get('method', 'plan')}+taylor{order}", "quality": {}}
    return dataclasses.replace(base, actions=forecast_rows(base), forecast_order=order, extras=extras,
                               provenance=prov)


def disca_plan(base: Plan, predictor: DisCaPredictor, training: dict | None = None) -> Plan:
    """The base plan with every non-computed cell forecast by `predictor` (stored in extras["forecaster"])."""
    extras = {**{k: v for k, v in base.extras.items() if k != "forecaster"},
              "forecaster": predictor.to_extras(training)}
    prov = {**base.provenance, "method": f"{base.provenance.get('method', 'plan')}+disca", "quality": {},
            "base_method": base.provenance.get("method")}
    return dataclasses.replace(base, actions=forecast_rows(base), forecast_order=predictor.order, extras=extras,
                               provenance=prov)


def plan_layout(plan: Plan) -> dict:
    return dict(model_class=plan.model_class, block_layout=list(plan.block_layout), granularity=plan.granularity,
                units=list(plan.units), probe_blocks=plan.probe_blocks, tail_blocks=plan.tail_blocks)


def train_disca(calib: Calibration, base_plans: Sequence[Plan], out_dir: str | os.PathLike,
                config: DisCaConfig = DisCaConfig(), *, runs: Sequence[Callable[[], Any]] | None = None,
                resume: bool = False, progress: bool = True, stop_after: int | None = None
                ) -> tuple[DisCaPredictor, dict]:
    """Record the calibration runs, build samples from the base plans' skipped cells, train the predictor."""
    plans = list(base_plans)
    if not plans:
        raise ValueError("train_disca needs at least one base plan (the cells it forecasts).")
    layouts = {repr(plan_layout(p)) for p in plans}
    if len(layouts) != 1:
        raise ValueError("the base plans of one DisCa predictor must share model, granularity, units and probe/tail "
                         "blocks; train one predictor per layout.")
    frozen = [p for p in calib.pipe.transformer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    runs = list(runs) if runs else [calib.generate]
    try:
        recording, timesteps = record_units(calib.pipe, runs, plans[0])
        parts = [build_samples(recording, timesteps, plans, config.order)]
        for source in config.rollout:
            for plan in plans:
                student = dataclasses.replace(plan, actions=forecast_rows(plan), forecast_order=config.order)
                rec, ts = record_units(calib.pipe, runs, plans[0], student=student, forecast=ROLLOUTS[source],
                                       order=config.order)
                parts.append(build_samples(rec, ts, [plan], config.order))
    finally:
        for p in frozen:
            p.requires_grad_(True)
    data = merge_samples(parts)
    predictor, summary = train_predictor(data, out_dir, config, layout=plan_layout(plans[0]), resume=resume,
                                         progress=progress, stop_after=stop_after)
    if config.online_iterations and (stop_after is None or stop_after > config.iterations):
        online_stop = None if stop_after is None else stop_after - config.iterations
        summary["online"] = finetune_online(calib.pipe, plans, runs, predictor, out_dir, config, progress=progress,
                                            stop_after=online_stop)
        summary["rel_mse_disca"] = evaluate(predictor, data)
    some_branch = next(iter(recording[0].values()))  # unit key -> step -> tensors of one call
    summary["tokens_per_call"] = {stream_name(key, i): int(t.numel() // t.shape[-1])
                                  for key, steps in some_branch.items()
                                  for i, t in enumerate(next(iter(steps.values())))}
    return predictor, summary


def choose_predictor(validation: Calibration, base: Plan, candidates: dict[str, DisCaPredictor | None],
                     order: int = 1) -> tuple[str, dict[str, float]]:
    """The candidate whose DisCa plan scores best on a validation set (None = the Taylor twin of `order`).

    A learned forecaster can fit its calibration runs and still lose to Taylor in closed loop on a given plan, so
    the choice is made on generations it never trained on; returns (name, validation quality of every candidate).
    """
    scores = {}
    for name, predictor in candidates.items():
        plan = taylor_plan(base, order) if predictor is None else disca_plan(base, predictor)
        scores[name] = float(validation.quality_fn(run_plan(validation, plan), validation.reference()))
    return max(scores, key=lambda n: (scores[n], n == "taylor")), scores


def predictor_flops_ratio(predictor: DisCaPredictor, plan: Plan, template: Template, tokens: dict[str, int]) -> float:
    """Predictor FLOPs of a replay of `plan` / block FLOPs of the uncached generation (the cost DisCa adds).

    tokens: stream name -> tokens per transformer call (batch x sequence) at the template's shapes.
    """
    def cell_cost(names) -> float:
        return sum(predictor.net(n).flops_per_token() * tokens.get(n, 0) for n in names)

    stack = Granularity(plan.granularity) is Granularity.STACK
    spent = 0.0
    for branch in template.branches:
        for row in plan._rows_for(branch):
            for u, a in enumerate(row):
                if a == Action.FORECAST.value:  # a stack cell forecasts every segment's tensors
                    spent += cell_cost([n for n in predictor.streams if stack or n.split(".")[0] == f"u{u}"])
    total = sum(template.block_cost) * template.num_steps * len(template.branches)
    return spent / total if total > 0 else 0.0


def disca_search(calib: Calibration, out_dir: str | os.PathLike, base_plans: dict[str, Plan],
                 config: DisCaConfig = DisCaConfig(), *, template: Template | None = None,
                 runs: Sequence[Callable[[], Any]] | None = None, resume: bool = False,
                 progress: bool = True) -> dict:
    """Train one predictor for `base_plans` (name -> plan), export a DisCa plan per base plan, measure it and its
    Taylor twin (same cells, same block FLOPs) on the calibration set, write the front (DisCa plans) + summary."""
    out = Path(out_dir)
    template = template or make_template(calib)
    predictor, summary = train_disca(calib, list(base_plans.values()), out, config, runs=runs, resume=resume,
                                     progress=progress)
    points, others = [], []
    for name, base in base_plans.items():
        plan = disca_plan(base, predictor, summary)
        points.append(FrontPoint(f"disca-{name}", plan, measure(calib, template, plan)))
        twin = taylor_plan(base, config.order)
        m = measure(calib, template, twin)
        others.append({"name": f"taylor{config.order}-{name}", "quality": m.quality, "compute_ratio": m.compute_ratio,
                       "metrics": m.metrics})
    front = write_front(out, "disca", points, others=others,
                        config={**asdict(config), "base_plans": sorted(base_plans), "params": predictor.num_params(),
                                "rel_mse_taylor": summary["rel_mse_taylor"],
                                "rel_mse_disca": summary["rel_mse_disca"]})
    if front:
        from dcache.plans.plan import atomic_write_text

        lines = ["", f"Taylor twins (same plans, forecast_order {config.order}, no predictor; same block FLOPs):", "",
                 "| plan | compute ratio | quality | metrics |", "|---|---|---|---|"]
        for o in others:
            metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                for k, v in o["metrics"].items())
            lines.append(f"| {o['name']} | {o['compute_ratio']:.3f} | {o['quality']:.4g} | {metrics} |")
        lines += ["", f"Predictor: {predictor.num_params()} parameters; relative MSE of the forecast on the "
                      f"calibration samples, Taylor -> DisCa: " + ", ".join(
                          f"{k} {summary['rel_mse_taylor'][k]:.4g} -> {summary['rel_mse_disca'][k]:.4g}"
                          for k in sorted(summary["rel_mse_disca"]))]
        for p in points:
            ratio = predictor_flops_ratio(predictor, p.plan, template, summary["tokens_per_call"])
            lines.append(f"- `{p.name}`: the predictor adds {ratio:.4f} of the uncached block FLOPs.")
        atomic_write_text(out / "summary.md", (out / "summary.md").read_text() + "\n".join(lines) + "\n")
    return front


# ------------------------------------------------------------------------------------------------ closed loop
def online_loss(pipe: Any, plan: Plan, predictor: DisCaPredictor, run: Callable[[], Any]) -> torch.Tensor:
    """One closed-loop generation of `run` with `plan`'s F cells served by the (trainable) predictor.

    At every call with forecast cells the uncached output on the same input is computed too (the engine's own
    uncached path); with d_t = (sigma_t - sigma_{t+1}) * (v_cached - v_uncached) per branch, the loss is
        sum_branch ( |sum_t d_t|^2 + sum_t |d_t|^2 ) / sum_branch sum_t |(sigma_t - sigma_{t+1}) v_uncached|^2
    i.e. the first-order error of the final sample (errors that cancel over the steps cost nothing) plus the
    per-step errors. The pipeline continues from the cached output (inference-time error accumulation).
    Returns the loss with its graph (call .backward()).
    """
    import dcache
    from dcache.plans.plan import PlanSchedule

    from ...disca import DisCaForecaster, sigma_of

    schedule = PlanSchedule(dataclasses.replace(plan, extras={k: v for k, v in plan.extras.items()
                                                                if k != "forecaster"}))
    schedule.forecaster = DisCaForecaster(predictor, trainable=True)
    handle = dcache.apply(pipe, schedule, count_flops=False)
    engine, transformer = handle.engine, pipe.transformer
    # The chain below dcache's transformer_call: the model's own forward (its diffusers hooks included), run
    # outside an open call (the post hook below fires after the call closed), so nothing in it is cached.
    uncached = engine.transformer_hook.chain
    deltas: dict[str, list[torch.Tensor]] = {}
    energy = [0.0]

    def pre(module, args, kwargs):
        torch.set_grad_enabled(True)

    def post(module, args, kwargs, output):
        rec = engine.record
        call = rec.calls[-1] if rec is not None and rec.calls else None
        student = first_output(output)
        if call is None or Action.FORECAST.value not in call.actions or not student.requires_grad:
            torch.set_grad_enabled(False)
            return replace_first_output(output, student.detach())
        n = rec.num_steps or (call.step + 1)
        w = sigma_of(rec.timesteps, call.step, n) - sigma_of(rec.timesteps, call.step + 1, n)
        with torch.no_grad():
            teacher = first_output(uncached(*args, **kwargs)).float()
        deltas.setdefault(call.branch, []).append(w * (student.float() - teacher))  # with grad
        torch.set_grad_enabled(False)
        energy[0] += float((w * teacher).pow(2).sum())
        return replace_first_output(output, student.detach())

    hooks = [transformer.register_forward_pre_hook(pre, with_kwargs=True),
             transformer.register_forward_hook(post, with_kwargs=True)]
    grad_before = torch.is_grad_enabled()
    try:
        run()
    finally:
        for h in hooks:
            h.remove()
        torch.set_grad_enabled(grad_before)
        handle.remove()
    if not deltas:
        raise ValueError("the closed-loop run forecast nothing: the plan has no FORECAST cell after step 0.")
    with torch.enable_grad():
        total = sum(torch.stack(d).sum(0).pow(2).sum() + sum(x.pow(2).sum() for x in d) for d in deltas.values())
        return total / max(energy[0], 1e-20)


def finetune_online(pipe: Any, plans: Sequence[Plan], runs: Sequence[Callable[[], Any]], predictor: DisCaPredictor,
                    out_dir: str | os.PathLike, config: DisCaConfig, *, progress: bool = True,
                    stop_after: int | None = None) -> dict:
    """Closed-loop fine-tuning (see online_loss): iteration i uses plan i % len(plans) and run i % len(runs).

    Checkpointed with the offline state in the same file after every iteration; resumes from it.
    """
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    ckpt = Path(out_dir) / CHECKPOINT
    state = _load(ckpt)
    frozen = [p for p in pipe.transformer.parameters() if p.requires_grad]
    for p in frozen:
        p.requires_grad_(False)
    predictor.train().requires_grad_(True)
    opt = torch.optim.AdamW(predictor.parameters(), lr=config.online_lr, weight_decay=config.weight_decay)
    start = _check_phase(state, ckpt, predictor, opt, "online_iteration", "online_optimizer")
    if start:
        predictor.load_state_dict(state["model"])
        opt.load_state_dict(state["online_optimizer"])
    students = [dataclasses.replace(p, actions=forecast_rows(p), forecast_order=config.order) for p in plans]
    losses: list[float] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=config.online_iterations, initial=min(start, config.online_iterations),
                   desc="disca closed loop", leave=False)
    try:
        for it in range(start, config.online_iterations):
            if stop_after is not None and it >= stop_after:
                break
            torch.manual_seed(config.seed * 1_000_003 + 7919 * it)  # nothing random inside; fixed anyway
            opt.zero_grad()
            loss = online_loss(pipe, students[it % len(students)], predictor, runs[it % len(runs)])
            with torch.enable_grad():
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
            state.update({"model": predictor.state_dict(), "online_optimizer": opt.state_dict(),
                          "online_iteration": it + 1})
            _save(ckpt, state)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{losses[-1]:.4g}")
    finally:
        if bar is not None:
            bar.close()
        for p in frozen:
            p.requires_grad_(True)
        predictor.eval().requires_grad_(False)
    return {"iterations": int(state.get("online_iteration", 0)), "losses": losses}
