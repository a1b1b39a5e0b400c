"""LeMiCa: lexicographic-minimax path caching on the step DAG (arXiv 2511.00090).

Nodes 0..N-1 are steps, plus a terminal node N. Edge i -> j (i < j <= N, j - i <= max_span) means: compute the
whole stack at i (and at j if j < N), reuse the stack residual of step i at steps i+1..j-1. Its weight is the
*global* error `error_fn(final images with only that segment cached, uncached images)`, measured offline on the
calibration set (edges i -> i+1 cache nothing and weigh 0). A schedule with B computed steps is a path 0 -> N
with B edges; LeMiCa picks the path whose edge-error vector, sorted in descending order, is lexicographically
smallest. The order is monotone under adding the same edge to two equally long paths, so a label-setting DP over
(node, edges used) that keeps the leximax-best label is exact.

forecast_order >= 1 (dcache's extension): the skipped steps of a segment are *forecast* (Taylor of that order from
the cached history) instead of reused, both when the edges are measured and in the exported plans, so the path is
chosen for the error forecasting actually makes (a measured edge's history is its start step and the step before).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

from dcache.actions import Granularity
from dcache.files.checks import is_number, same
from dcache.files.atomic import read_json
from dcache.plans.plan import Plan
from dcache.files.state_file import StateFileError

from .core import (Calibration, FrontPoint, Template, distributed_map, is_main_process, make_template, measure,
                   run_plan, write_front, write_json)

ErrorFn = Callable[[torch.Tensor, torch.Tensor], float]


def l1_error(images: torch.Tensor, reference: torch.Tensor) -> float:
    return float((images.float() - reference.float()).abs().mean())


@dataclass(frozen=True)
class LeMiCaConfig:
    budgets: tuple[int, ...] = ()  # computed steps B per plan; empty: ratios 0.5 and 0.33 of the steps
    max_span: int = 8  # longest edge (reused steps + 1)
    forecast_order: int = 0  # 0: skipped steps reuse (LeMiCa); k >= 1: they are forecast with Taylor of order k

    def __post_init__(self) -> None:
        if self.forecast_order < 0:
            raise ValueError(f"forecast_order={self.forecast_order} must be >= 0 (0 = reuse, 1 = linear forecast).")
        if self.max_span < 2:
            raise ValueError(f"max_span={self.max_span} must be >= 2 (span 1 caches nothing).")
        if any(b < 1 for b in self.budgets):
            raise ValueError(f"budgets {self.budgets} must be >= 1 computed steps each.")


def segment_rows(num_steps: int, i: int, j: int, skip: str = "R") -> list[str]:
    return [skip if i < s < j else "C" for s in range(num_steps)]


def path_rows(num_steps: int, nodes: Sequence[int], skip: str = "R") -> list[str]:
    keep = set(nodes)
    return ["C" if s in keep else skip for s in range(num_steps)]


def _stack_plan(template: Template, rows: list[str], forecast_order: int, **kwargs) -> Plan:
    plan = template.plan(Granularity.STACK, rows, **kwargs)
    return dataclasses.replace(plan, forecast_order=forecast_order) if forecast_order else plan


def edge_weights(calib: Calibration, template: Template, max_span: int, error_fn: ErrorFn = l1_error,
                 cache_path: str | os.PathLike | None = None, progress: bool = True,
                 forecast_order: int = 0) -> dict[tuple[int, int], float]:
    """Global error of every edge i -> j (span 2..max_span), one cached generation each; saved to cache_path."""
    n = template.num_steps
    edges = [(i, j) for i in range(n) for j in range(i + 2, min(n, i + max_span) + 1)]
    done: dict[tuple[int, int], float] = {}
    if cache_path is not None and Path(cache_path).is_file():
        done = _saved_edges(Path(cache_path), n, forecast_order, edges)
    todo = [e for e in edges if e not in done]
    bar = None
    if progress and is_main_process() and todo:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(edges), initial=len(done), desc="lemica edges", leave=False)
    ref = calib.reference()

    def weigh(edge: tuple[int, int]) -> float:
        skip = "F" if forecast_order else "R"
        plan = _stack_plan(template, segment_rows(n, *edge, skip=skip), forecast_order, method="lemica-edge")
        return float(error_fn(run_plan(calib, plan), ref))

    # one edge per process per round, saved after each round: the bar moves with every edge, and an interrupted
    # search resumes from cache_path having lost at most the edges in flight
    from accelerate import PartialState

    chunk = PartialState().num_processes
    for start in range(0, len(todo), chunk):
        part = todo[start:start + chunk]
        for e, w in zip(part, distributed_map(weigh, part)):
            done[e] = w
        if cache_path is not None and is_main_process():
            write_json(cache_path, {"num_steps": n, "max_span": max_span, "forecast_order": forecast_order,
                                    "edges": {f"{i}-{j}": w for (i, j), w in sorted(done.items())}})
        if bar is not None:
            bar.update(len(part))
    if bar is not None:
        bar.close()
    for i in range(n):
        done[(i, i + 1)] = 0.0
    return {e: done[e] for e in list(edges) + [(i, i + 1) for i in range(n)]}


MAX_EDGES_BYTES = 64 << 20  # one "i-j": weight pair per edge; a 1000-step search with spans of 100 is ~2 MB


def _saved_edges(path: Path, n: int, forecast_order: int, edges: list[tuple[int, int]]) -> dict:
    """The edges measured by an earlier run of this search (edges.json), {} when it was made for other steps or
    another forecast order; StateFileError naming the file and the fix when it holds anything else than edges of
    this DAG with finite errors >= 0 (a weight read as given would steer the path search)."""
    fix = "delete it (the rerun measures the edges again) or pass a new --out"
    data = read_json(path, MAX_EDGES_BYTES, "LeMiCa edge file", fix, StateFileError)
    if not isinstance(data, dict) or not isinstance(data.get("edges"), dict):
        raise StateFileError(f"the LeMiCa edge file {str(path)!r} holds no table of edges; {fix}.")
    if not same(data.get("num_steps"), n) or not same(data.get("forecast_order", 0), forecast_order):
        return {}
    def edge(key: str) -> tuple[int, int] | None:  # "i-j" with 0 <= i, i + 2 <= j <= n (any span: max_span may grow)
        i, _, j = key.partition("-")
        if not (i.isdecimal() and j.isdecimal() and len(i) < 6 and len(j) < 6):
            return None
        return (int(i), int(j)) if int(i) + 2 <= int(j) <= n else None

    saved = {edge(k): w for k, w in data["edges"].items()}
    if None in saved or not all(is_number(w, 0.0) for w in saved.values()):
        raise StateFileError(f"the LeMiCa edge file {str(path)!r} holds entries that are not edges i-j of this "
                             f"{n}-step search with an error >= 0; {fix}.")
    wanted = set(edges)
    return {e: float(w) for e, w in saved.items() if e in wanted}


def leximax_path(num_steps: int, weights: dict[tuple[int, int], float], budget: int) -> tuple[list[int], list[float]]:
    """Nodes (computed steps) of the path 0 -> N with exactly `budget` edges whose descending-sorted edge-weight
    vector is lexicographically smallest. Raises if no such path exists (budget too small for max_span)."""
    n = num_steps
    if not 1 <= budget <= n:
        raise ValueError(f"budget={budget} computed steps must be in 1..{n}.")
    # best[(node, edges)] = (sorted-desc weights, path nodes)
    best: dict[tuple[int, int], tuple[list[float], list[int]]] = {(0, 0): ([], [0])}
    for k in range(budget):
        for node in range(n):
            label = best.get((node, k))
            if label is None:
                continue
            for (i, j), w in weights.items():
                if i != node:
                    continue
                vec = sorted(label[0] + [w], reverse=True)
                cand = (vec, label[1] + [j])
                cur = best.get((j, k + 1))
                if cur is None or (cand[0], cand[1]) < (cur[0], cur[1]):
                    best[(j, k + 1)] = cand
    final = best.get((n, budget))
    if final is None:
        raise ValueError(f"no schedule with {budget} computed steps: the longest edge spans "
                         f"{max(j - i for i, j in weights)} steps; raise max_span or the budget.")
    return final[1][:-1], final[0]


def default_budgets(num_steps: int) -> tuple[int, ...]:
    return tuple(sorted({max(2, round(num_steps * r)) for r in (0.5, 0.33)}, reverse=True))


def lemica_search(calib: Calibration, out_dir: str | os.PathLike, config: LeMiCaConfig = LeMiCaConfig(), *,
                  error_fn: ErrorFn = l1_error, template: Template | None = None, progress: bool = True) -> dict:
    """Measure the DAG (cached in out_dir/edges.json, so a rerun resumes), solve each budget, write the front."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    template = template or make_template(calib)
    n = template.num_steps
    budgets = config.budgets or default_budgets(n)
    weights = edge_weights(calib, template, config.max_span, error_fn, out / "edges.json", progress,
                           config.forecast_order)
    points = []
    for b in budgets:
        nodes, vec = leximax_path(n, weights, b)
        plan = lemica_plan(template, nodes, budget=b, config=config, edge_errors=vec)
        points.append(FrontPoint(f"lemica-B{b}", plan, measure(calib, template, plan)))
    return write_front(out, "lemica", points, config={**asdict(config), "budgets": list(budgets)})


def lemica_plan(template: Template, nodes: Sequence[int], *, budget: int, config: LeMiCaConfig | None = None,
                edge_errors: Sequence[float] = ()) -> Plan:
    order = config.forecast_order if config else 0
    return _stack_plan(template, path_rows(template.num_steps, nodes, "F" if order else "R"), order, method="lemica",
                       config={**(asdict(config) if config else {}), "budget": budget},
                       extras={"compute_steps": list(nodes), "edge_errors_desc": list(edge_errors)})
