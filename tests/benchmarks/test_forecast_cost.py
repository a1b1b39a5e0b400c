"""benchmarks/forecast_cost.py on small tensors: it times what it says (the fit kept through the history, or made at
every forecast, which give the same forecasts) and writes its table with the command and commit."""

import json

import torch


def test_kept_and_refit_serve_the_same_forecast_and_the_table_names_its_run(tmp_path, monkeypatch, load_benchmark):
    cost = load_benchmark("forecast_cost")
    for name in cost.FORECASTERS:
        f = cost.build_forecaster(name)
        f.num_steps = 28
        hist = cost.history(f, (2, 8, 3), "cpu", torch.float32)
        steps, values = [float(s) for s, _ in hist.samples], [v[0] for _, v in hist.samples]
        for step in cost.TARGETS:
            assert torch.equal(f(hist, step)[0], f.extrapolate(steps, values, float(step))), name
        assert (name in ("hyca", "dmd")) == bool(hist.fitted), name  # what has a fit keeps it in the history
    monkeypatch.setattr(cost, "SIZES", {"small": (1, 8, 3)})
    path = cost.main(["--repeats", "1", "--out", str(tmp_path)])
    table = path.read_text()
    assert "| small | [1, 8, 3] |" in table and "python benchmarks/forecast_cost.py --repeats 1 --out" in table
    data = json.loads((tmp_path / "forecast_cost.json").read_text())
    assert set(data["rows"]["small"]) == {"shape", "taylor", *cost.FORECASTERS}
    assert all(data["rows"]["small"][n]["kept"] > 0 and data["rows"]["small"][n]["refit"] > 0
               for n in cost.FORECASTERS)
