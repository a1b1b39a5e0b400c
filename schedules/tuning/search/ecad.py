"""ECAD: NSGA-II over binary compute/reuse genomes per step x block x component (arXiv 2506.15682).

Genome: bit (s, u) = 1 computes MODULE unit u (attention, MLP, context MLP, ... as the adapter names them) at step
s = 1..N-1 (step 0 always computes). The same rows serve every CFG branch. Objectives (both minimised by pymoo):
(-quality on the calibration set, compute ratio in counted block FLOPs). Constraint: at least one reused unit
(the all-compute default is not a candidate). Operators as ECAD: 4-point crossover (p=0.9), bit-flip mutation.

dcache's extensions (ECADConfig), both off by default (the reference):
  * `granularity`: the genome's unit: "module" (ECAD), "block" (one bit per block and step) or "stack" (one bit
    per step: (N-1) bits, a space small enough for a few hundred evaluations to search it well).
  * `forecast_order` k >= 1: a 0 bit is FORECAST (Taylor of order k from the unit's cached history) instead of
    REUSE, in the evaluated candidates and in the exported plans, so the search optimises the quality that a replay
    actually produces. With forecasting, where the computed steps sit matters differently than with reuse (the
    history of a forecast is the last k + 1 computed steps), so searching reuse plans and forecasting them
    afterwards (the "+taylor" twins) optimises the wrong objective.

The initial population holds the seeds (heuristic fixed-interval schedules and the recorded plans of dynamic
methods, converted to the genome's rows) and random genomes; seeds that do not fit in it are scored into the archive
(so the front is never worse than any seed). After every generation the state (the initial population, the
algorithm's settings, the archive of evaluated genomes with their scores, the generation count) is written atomically
to `checkpoint.safetensors` (JSON + arrays, no pickle); `resume=True` rebuilds the algorithm and replays its
generations from the archive (NSGA-II with its seeded generator is deterministic given the scores), so it reaches the
same front as an uninterrupted run without evaluating anything twice.
Candidates are evaluated over the processes of `accelerate launch` (one process runs the same code).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from dcache.actions import Action, Granularity
from dcache.plans.plan import Plan
from dcache.files.checks import same
from dcache.files.atomic import remove_stale_temporaries
from dcache.files.state_file import StateFileError, load_state, refuse_legacy, save_state

from .checkpoint_checks import FIX, check_ecad, damaged, field
from .core import (Calibration, FrontPoint, Measured, Template, convert_rows, distributed_map, is_main_process,
                   make_template, measure, pareto_mask, write_front)

CHECKPOINT = "checkpoint.safetensors"  # dcache.files.state_file: JSON + arrays, never a pickle
LEGACY_CHECKPOINT = "checkpoint.pkl"  # what older versions pickled; refused, never opened
# NSGA-II's non-dominated sort costs O(pop_size^2) per generation and every genome is a calibration generation:
# populations beyond a few thousand are never searched; the bound also caps what a checkpoint may ask to allocate.
MAX_POP_SIZE = 4096
MAX_GENERATIONS = 100_000


@dataclass(frozen=True)
class ECADConfig:
    pop_size: int = 16
    generations: int = 8
    seed: int = 0
    crossover_prob: float = 0.9
    crossover_points: int = 4
    mutation_prob: float = 0.9  # probability that an offspring is mutated at all
    mutation_bits: float = 0.02  # per-bit flip probability of a mutated offspring
    random_compute_fraction: float = 0.5  # P(bit = compute) in the random part of the initial population
    granularity: str = "module"  # genome unit: "module" (ECAD), "block", or "stack" (one bit per step)
    forecast_order: int = 0  # 0: a 0 bit reuses (ECAD); k >= 1: it forecasts with Taylor of order k
    # After the generations, for each of these compute ratios: hill-climb from the best plan at or under it by moving
    # one computed cell to a step at most `polish_reach` away in the same unit (the compute ratio is kept), while a
    # neighbour scores better; at most `polish_evaluations` neighbours looked at per ratio (archived ones are free).
    polish_ratios: tuple[float, ...] = ()
    polish_evaluations: int = 60
    polish_reach: int = 1

    def __post_init__(self) -> None:
        allowed = [g.value for g in Granularity]
        if self.granularity not in allowed:
            raise ValueError(f"granularity={self.granularity!r} must be one of {allowed}: the unit one genome bit "
                             f"decides per step (module = attention / MLP of a block, as ECAD).")
        if not 0 <= self.forecast_order <= 4:
            raise ValueError(f"forecast_order={self.forecast_order} must be in 0..4: 0 reuses the cached output at a "
                             f"skipped cell (ECAD), k forecasts it with a Taylor series of order k.")
        bad = [r for r in self.polish_ratios if not 0.0 < r <= 1.0]
        if bad:
            raise ValueError(f"polish_ratios={self.polish_ratios}: {bad} are not compute ratios in (0, 1] (the "
                             f"budgets whose best plan is refined by local moves).")
        for name in ("polish_evaluations", "polish_reach"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")
        if not 4 <= self.pop_size <= MAX_POP_SIZE:
            raise ValueError(f"pop_size={self.pop_size} must be in 4..{MAX_POP_SIZE} (NSGA-II needs parents and "
                             f"offspring; each genome of a generation costs a calibration run).")
        if not 1 <= self.generations <= MAX_GENERATIONS:
            raise ValueError(f"generations={self.generations} must be in 1..{MAX_GENERATIONS}.")
        for name in ("crossover_prob", "mutation_prob", "mutation_bits", "random_compute_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ValueError(f"{name}={v} must be a probability in [0, 1].")


# ------------------------------------------------------------------------------------------------ genome <-> plan
def genome_to_rows(x: np.ndarray, template: Template, granularity: Granularity | str = Granularity.MODULE,
                   skip: str = Action.REUSE.value) -> list[str]:
    """Action rows (step 0 all-compute) of a genome; a 0 bit becomes `skip` (REUSE, or FORECAST)."""
    u = len(template.units(granularity))
    bits = np.asarray(x, dtype=bool).reshape(template.num_steps - 1, u)
    return ["C" * u] + ["".join("C" if b else skip for b in row) for row in bits]


def genome_plan(x: np.ndarray, template: Template, ecad: "ECADConfig", **kwargs) -> Plan:
    """The plan of a genome at ecad.granularity, with FORECAST cells (and forecast_order) when ecad asks for them;
    kwargs go to Template.plan (method, config, extras)."""
    skip = Action.FORECAST.value if ecad.forecast_order else Action.REUSE.value
    plan = template.plan(ecad.granularity, genome_to_rows(x, template, ecad.granularity, skip), **kwargs)
    return dataclasses.replace(plan, forecast_order=ecad.forecast_order) if ecad.forecast_order else plan


def seed_rows(plan: Plan, template: Template, granularity: Granularity | str) -> list[str]:
    """A seed plan's rows at the genome's granularity (first branch). Finer rows become coarser ones by letting a
    coarse unit compute where any of its parts computes (a module plan seeds a stack genome with the steps where it
    computes anything); coarser rows become finer ones as `convert_rows` does."""
    g, src = Granularity(granularity), Granularity(plan.granularity)
    if src is not Granularity.MODULE or g is Granularity.MODULE:
        return convert_rows(plan, template, g)
    rows = convert_rows(plan, template, Granularity.MODULE)
    blocks = ["".join("C" if any(r[u] == "C" for u, b in enumerate(template.module_block) if b == i) else "R"
                      for i in range(template.num_blocks)) for r in rows]
    return blocks if g is Granularity.BLOCK else ["C" if "C" in r else "R" for r in blocks]


def rows_to_genome(rows: Sequence[str]) -> np.ndarray:
    return np.array([[c == "C" for c in row] for row in rows[1:]], dtype=bool).reshape(-1)


def genome_key(x: np.ndarray) -> str:
    return hashlib.sha1(np.packbits(np.asarray(x, dtype=bool)).tobytes()).hexdigest()


def heuristic_seeds(template: Template, granularity: Granularity | str = Granularity.MODULE) -> dict[str, np.ndarray]:
    """Fixed-interval schedules: every k-th step computes; in between, reuse all units, or (module level) only the
    MLPs or only the attentions (ECAD's population initialisation is built from such heuristics)."""
    n, units = template.num_steps, template.units(granularity)
    kinds = [("all", np.ones(len(units), bool))]
    if Granularity(granularity) is Granularity.MODULE:
        is_attn = np.array(["attn" in u.split(".", 1)[1] for u in units])
        kinds += [("mlp", ~is_attn), ("attn", is_attn)]
    seeds: dict[str, np.ndarray] = {}
    for k in (2, 3, 4, 5):
        for kind, reuse in kinds:
            rows = []
            for s in range(n):
                full = s % k == 0 or s == n - 1
                rows.append("".join("C" if full or not r else "R" for r in reuse))
            seeds[f"fixed{k}-{kind}"] = rows_to_genome(rows)
    return seeds


# ------------------------------------------------------------------------------------------------ search
# The fields of ECADConfig that shape the NSGA-II run itself: a resume rebuilds the algorithm from the checkpoint's.
ALGORITHM_FIELDS = ("pop_size", "seed", "crossover_prob", "crossover_points", "mutation_prob", "mutation_bits")
STATE_KIND = "ECAD checkpoint"


class _State:
    """Everything a resume needs, as data: the initial population and the algorithm settings (the algorithm is
    rebuilt from them and replayed: NSGA-II with its own seeded generator is a deterministic function of the scores
    it is told, and every score is in the archive), the archive, the generation counter, the seed names."""

    def __init__(self, algorithm, archive: dict, generation: int, seeds: dict[str, str], genome: dict,
                 x0: np.ndarray, settings: dict):
        self.algorithm, self.archive, self.generation, self.seeds = algorithm, archive, generation, seeds
        self.genome = genome  # {"granularity", "forecast_order"} the archive was evaluated with
        self.x0, self.settings = x0, settings

    def to_data(self) -> dict:
        return {"archive": self.archive, "generation": self.generation, "seeds": self.seeds, "genome": self.genome,
                "x0": self.x0, "settings": self.settings}


def _save(path: Path, state: _State) -> None:
    save_state(path, state.to_data(), STATE_KIND)


def _algorithm(x0: np.ndarray, settings: dict, problem, generations: int):
    from pymoo.algorithms.moo.nsga2 import NSGA2
    from pymoo.operators.crossover.pntx import PointCrossover
    from pymoo.operators.mutation.bitflip import BitflipMutation

    algorithm = NSGA2(pop_size=settings["pop_size"], sampling=np.array(x0, dtype=bool),
                      crossover=PointCrossover(prob=settings["crossover_prob"], n_points=settings["crossover_points"]),
                      mutation=BitflipMutation(prob=settings["mutation_prob"], prob_var=settings["mutation_bits"]),
                      eliminate_duplicates=True)
    algorithm.setup(problem, termination=("n_gen", generations), seed=settings["seed"], verbose=False)
    return algorithm


def _generation(state: _State, problem, evaluate: Callable | None) -> None:
    """One NSGA-II generation: ask, score what the archive lacks (evaluate None: a replay, all scores known), tell."""
    from pymoo.core.evaluator import Evaluator
    from pymoo.problems.static import StaticProblem

    pop = state.algorithm.ask()
    xs = [np.asarray(x, dtype=bool) for x in pop.get("X")]
    todo = [x for x in {genome_key(x): x for x in xs}.values() if genome_key(x) not in state.archive]
    if todo and evaluate is None:
        raise StateFileError(f"the archive lacks {len(todo)} genomes of generation {state.generation + 1}: it was "
                             f"edited or damaged; delete it to start over.")
    for x, r in zip(todo, distributed_map(evaluate, todo) if todo else []):
        state.archive[genome_key(x)] = {**r, "genome": np.packbits(x)}
    f = np.array([[-state.archive[genome_key(x)]["quality"], state.archive[genome_key(x)]["compute_ratio"]]
                  for x in xs])
    g = np.array([[0.5 - (~x).sum()] for x in xs])  # <= 0 iff at least one unit is reused
    Evaluator().eval(StaticProblem(problem, F=f, G=g), pop)
    state.algorithm.tell(infills=pop)


def _resume(ckpt: Path, problem, n_var: int, genome: dict, generations: int) -> _State:
    """The state of the checkpoint at `ckpt`, its algorithm replayed to the saved generation (no evaluation)."""
    refuse_legacy(ckpt.with_name(LEGACY_CHECKPOINT), STATE_KIND, "delete it to start over, or pass a new --out")
    data = load_state(ckpt, STATE_KIND, FIX)
    x0 = field(data, "x0", ckpt, STATE_KIND)
    if isinstance(x0, np.ndarray) and x0.ndim == 2 and x0.shape[1] != n_var:
        raise ValueError(f"the checkpoint in {ckpt.parent} is for a genome of {x0.shape[-1]} bits, this model/steps "
                         f"give {n_var}; use a new output folder.")
    made = field(data, "genome", ckpt, STATE_KIND)
    if not same(made, genome):
        raise ValueError(f"the checkpoint in {ckpt.parent} was searched with {made}, this config asks for {genome}: "
                         f"its archive scores other plans; use a new output folder.")
    check_ecad(data, ckpt, STATE_KIND, n_var=n_var, max_pop=MAX_POP_SIZE, max_generations=MAX_GENERATIONS,
               genome_key=genome_key)
    settings = {k: data["settings"][k] for k in ALGORITHM_FIELDS}
    state = _State(_algorithm(x0, settings, problem, generations), data["archive"], 0, data["seeds"], genome, x0,
                   settings)
    for _ in range(data["generation"]):
        try:
            _generation(state, problem, None)
        except StateFileError as exc:  # the replay asked for a genome the archive lacks
            raise damaged(ckpt, STATE_KIND, str(exc).split(":")[0]) from None
        state.generation += 1
    return state


def ecad_search(calib: Calibration, out_dir: str | os.PathLike, config: ECADConfig = ECADConfig(), *,
                seed_plans: dict[str, Plan] | None = None, resume: bool = False, template: Template | None = None,
                on_generation: Callable[[int, dict], None] | None = None, progress: bool = True) -> dict:
    """Run (or resume) the NSGA-II search; write plans, front.json, front.png and summary.md to `out_dir`.

    seed_plans:    plans of other methods (any granularity) put into the initial population.
    on_generation: called as fn(generation, info) after each generation's checkpoint is written.
    Returns the front dict (as written to front.json).
    """
    from pymoo.core.problem import Problem

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = out / CHECKPOINT
    template = template or make_template(calib)
    n_var = (template.num_steps - 1) * len(template.units(config.granularity))
    problem = Problem(n_var=n_var, n_obj=2, n_ieq_constr=1, xl=0, xu=1, vtype=bool)
    genome = {"granularity": config.granularity, "forecast_order": config.forecast_order}

    def evaluate(x: np.ndarray) -> dict:
        return measure(calib, template, genome_plan(x, template, config, method="ecad")).to_dict()

    if resume:
        remove_stale_temporaries(out)  # a run killed (kill -9) while writing a file left its temporary file
    if resume and (ckpt.is_file() or (out / LEGACY_CHECKPOINT).exists()):
        state = _resume(ckpt, problem, n_var, genome, config.generations)
    else:
        # seed order: whole-step fixed intervals, then the given plans, then the per-component heuristics
        heuristics = heuristic_seeds(template, config.granularity)
        seeds = {k: v for k, v in heuristics.items() if k.endswith("-all")}
        seeds.update({name: rows_to_genome(seed_rows(plan, template, config.granularity))
                      for name, plan in (seed_plans or {}).items()})
        seeds.update({k: v for k, v in heuristics.items() if not k.endswith("-all")})
        seeds = {k: v for k, v in seeds.items() if not v.all()}
        rng = np.random.default_rng(config.seed)
        uniq: dict[str, np.ndarray] = {}
        for v in seeds.values():
            uniq.setdefault(genome_key(v), v)
        n_seeded = max(1, config.pop_size - config.pop_size // 4)  # keep some random diversity
        x0, overflow = list(uniq.values())[:n_seeded], list(uniq.values())[n_seeded:]
        while len(x0) < config.pop_size:
            x0.append(rng.random(n_var) < config.random_compute_fraction)
        x0 = np.array(x0, dtype=bool)
        settings = {k: getattr(config, k) for k in ALGORITHM_FIELDS}
        state = _State(_algorithm(x0, settings, problem, config.generations), {}, 0,
                       {name: genome_key(v) for name, v in seeds.items()}, genome, x0, settings)
        # seeds beyond the initial population are scored too: the front is never worse than a seed it was given
        for x, r in zip(overflow, distributed_map(evaluate, overflow)):
            state.archive[genome_key(x)] = {**r, "genome": np.packbits(x)}
        if overflow and is_main_process():
            _save(ckpt, state)

    bar = _bar(progress, config.generations, state.generation)
    while state.generation < config.generations:
        _generation(state, problem, evaluate)
        state.generation += 1
        if is_main_process():
            _save(ckpt, state)
        info = _gen_info(state)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(evaluated=len(state.archive), best_q_at_half=info["best_quality_at_0.5"])
        if on_generation is not None:
            on_generation(state.generation, info)
    if bar is not None:
        bar.close()
    for ratio in config.polish_ratios:
        _polish(state, ratio, config, evaluate, template.num_steps, n_var, ckpt)
    return _finish(state, template, out, config)


def shift_moves(x: np.ndarray, num_steps: int, reach: int = 1) -> list[np.ndarray]:
    """Genomes with one computed cell moved by 1..reach steps within its unit's column (onto a non-computed cell):
    every unit keeps its number of computed steps, so the compute ratio is unchanged. Deterministic order."""
    bits = np.asarray(x, dtype=bool).reshape(num_steps - 1, -1)
    out = []
    for s, u in zip(*np.nonzero(bits)):
        for d in [d for r in range(1, reach + 1) for d in (-r, r)]:
            t = s + d
            if 0 <= t < num_steps - 1 and not bits[t, u]:
                y = bits.copy()
                y[s, u], y[t, u] = False, True
                out.append(y.reshape(-1))
    return out


def _polish(state: _State, ratio: float, config: ECADConfig, evaluate, num_steps: int, n_var: int,
            ckpt: Path) -> None:
    """Best-improvement hill climbing at `ratio` (see ECADConfig.polish_ratios); evaluations go to the archive.

    The walk depends only on the archive's scores, so a resumed search replays it from the archive for free."""
    def best_key() -> str | None:
        keys = [k for k, e in state.archive.items() if e["compute_ratio"] <= ratio + 1e-9]
        return max(keys, key=lambda k: (state.archive[k]["quality"], -state.archive[k]["compute_ratio"], k)) \
            if keys else None

    looked = 0
    key = best_key()
    while key is not None and looked < config.polish_evaluations:
        x = np.unpackbits(state.archive[key]["genome"])[:n_var].astype(bool)
        moves = list({genome_key(y): y for y in shift_moves(x, num_steps, config.polish_reach)}.values())
        moves = moves[: config.polish_evaluations - looked]
        looked += len(moves)
        todo = [y for y in moves if genome_key(y) not in state.archive]
        for y, r in zip(todo, distributed_map(evaluate, todo)):
            state.archive[genome_key(y)] = {**r, "genome": np.packbits(y), "polish": ratio}
        if todo and is_main_process():
            _save(ckpt, state)
        new = best_key()
        if new == key:
            break
        key = new


def _bar(progress: bool, total: int, initial: int):
    if not progress or not is_main_process():
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="ecad generations", leave=False)


def _gen_info(state: _State) -> dict:
    entries = list(state.archive.values())
    under = [e["quality"] for e in entries if e["compute_ratio"] <= 0.5]
    return {"evaluated": len(entries), "best_quality_at_0.5": round(max(under), 3) if under else None}


def _finish(state: _State, template: Template, out: Path, config: ECADConfig) -> dict:
    keys = list(state.archive)
    q = np.array([state.archive[k]["quality"] for k in keys])
    c = np.array([state.archive[k]["compute_ratio"] for k in keys])
    keep = pareto_mask(q, c)
    seed_names: dict[str, str] = {}
    for name, key in state.seeds.items():  # the first name of a genome wins (user seeds come first)
        seed_names.setdefault(key, name)
    points, others = [], []
    n_var = (template.num_steps - 1) * len(template.units(config.granularity))
    for i, k in enumerate(keys):
        e = state.archive[k]
        others.append({"quality": e["quality"], "compute_ratio": e["compute_ratio"], "seed": seed_names.get(k)})
        if keep[i]:
            x = np.unpackbits(e["genome"])[:n_var].astype(bool)
            plan = genome_plan(x, template, config, method="ecad", config=asdict(config),
                               extras={"seed": seed_names[k]} if k in seed_names else None)
            name = f"ecad-{len(points):02d}-r{e['compute_ratio']:.3f}"
            points.append(FrontPoint(name, plan, Measured(e["quality"], e["compute_ratio"], e["metrics"])))
    return write_front(out, "ecad", points, others=others,
                       config={**asdict(config), "generations_run": state.generation})
