"""Context parallel (diffusers `enable_parallelism`, Ulysses, 2 CPU processes over gloo): every rank takes the same
decision, and the decisions, signals and outputs are those of the single-process run.

Under context parallel each rank holds half of the tokens, so signals measured on hidden states are rank-local;
`dcache.runtime.parallel.sync_signals` all-reduces them. The ranks run in `cp_worker.py` (forked once for all checks, a
few seconds); this file asserts on what they saved. See cp_worker.py for the one CPU-only workaround (diffusers
divides by the accelerator count, which is 0 here).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch
import torch.multiprocessing as mp
from cp_worker import RUNS, run, warm_imports

from dcache.actions import POST_SIGNALS

pytestmark = pytest.mark.distributed
WORLD = 2
TIMEOUT_S = 240  # fork + 7 generations on a loaded 2-core machine; a hang in a collective errors after 60 s


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    out = tmp_path_factory.mktemp("cp")
    warm_imports()
    # fork, not spawn: the ranks inherit this process's imports (torch, diffusers, dcache: ~6 s of CPU each to redo)
    context = mp.start_processes(run, args=(WORLD, _free_port(), str(out)), nprocs=WORLD, join=False,
                                 start_method="fork")
    deadline = time.monotonic() + TIMEOUT_S
    while not context.join(timeout=5):
        if time.monotonic() > deadline:
            for p in context.processes:
                p.kill()
            pytest.fail(f"context-parallel ranks did not finish in {TIMEOUT_S} s (a hang: ranks disagreeing?)")
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r} failed:\n{res.get('error')}"
    return results


CP_RUNS = [(m, "cp-then-apply") for m, _ in RUNS] + [("fbcache", "apply-then-cp")]
FLUSHED = {s.value for s in POST_SIGNALS}


def decided_on(calls: list) -> list:
    """The call records without what the end-of-generation flush adds: the post signals (output change, ...) of a
    branch's last call when it computed; no decision of the generation reads them (they are checked on their own in
    test_end_of_generation_signals_agree_across_ranks)."""
    last = {branch: i for i, (_, branch, _, _) in enumerate(calls)}
    return [(step, branch, actions, {k: v for k, v in sig.items()
                                     if not (i == last[branch] and set(actions) == {"C"} and k in FLUSHED)})
            for i, (step, branch, actions, sig) in enumerate(calls)]


@pytest.mark.parametrize("method, order", CP_RUNS)
def test_every_rank_takes_the_same_decisions_with_the_same_signals(ranks, method, order):
    a, b = (r["runs"][(method, order)] for r in ranks)
    assert a["actions"] == b["actions"]
    assert decided_on(a["calls"]) == decided_on(b["calls"])  # bit-identical: the same all-reduce result
    assert a["compute_ratio"] == b["compute_ratio"]
    assert any("R" in row for rows in a["actions"].values() for row in rows), "no reuse: the check would be empty"


@pytest.mark.parametrize("method, order", CP_RUNS)
def test_decisions_signals_and_output_match_the_single_process_run(ranks, method, order):
    cp, single = ranks[0]["runs"][(method, order)], ranks[0]["runs"][(method, "single")]
    assert cp["actions"] == single["actions"]
    assert [c[:3] for c in cp["calls"]] == [c[:3] for c in single["calls"]]
    for (step, branch, _, got), (_, _, _, want) in zip(decided_on(cp["calls"]), decided_on(single["calls"])):
        assert got.keys() == want.keys()
        for name in want:  # sharded sums/means differ from unsharded ones in float rounding only (~1e-7)
            assert got[name] == pytest.approx(want[name], rel=1e-5, abs=1e-7), (step, branch, name)
    # Ulysses attention on CPU differs from single-process attention by ~2e-7 per call (measured)
    assert (cp["out"] - single["out"]).abs().max().item() < 1e-5
    # (compute_ratio is not compared: a rank's FLOP mix differs from one process's, since Ulysses runs attention
    # over all tokens with half the heads and the linears over half the tokens; the unit decisions above are equal)


@pytest.mark.parametrize("method", [m for m, _ in RUNS])
def test_rank_local_signals_differ_and_the_synced_ones_agree(ranks, method):
    """The control: without the all-reduce the ranks would decide on different numbers."""
    local = [torch.cat([x for x, _ in r["runs"][(method, "cp-then-apply")]["exchanged"]]) for r in ranks]
    synced = [torch.cat([y for _, y in r["runs"][(method, "cp-then-apply")]["exchanged"]]) for r in ranks]
    assert torch.equal(synced[0], synced[1])
    gap = ((local[0] - local[1]).abs() / local[0].abs().clamp_min(1e-12)).max().item()
    assert gap > 1e-2, f"rank-local signals agree to {gap:.1e}: the tokens are not sharded, the check is empty"


def test_end_of_generation_signals_agree_across_ranks(ranks):
    """Engine._sync_post (the end-of-generation flush of a branch's last computed call's post signals, which
    calibration reads) goes through dcache.runtime.parallel too."""
    a, b = (r["runs"][("easycache", "cp-then-apply")] for r in ranks)
    assert a["calls"] == b["calls"]

