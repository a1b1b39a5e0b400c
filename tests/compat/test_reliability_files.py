"""Files dcache writes are created like `open(path, "w")` creates them: mode 0666 minus the umask (0644 under the
usual 022, 0640 under 027), for every kind of output (plans, stats / any JSON, search fronts with front.png and
summary.md, calibration files, image grids, GIFs, plots, resume state files); and nothing half-written or temporary is
left when a write fails."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from dcache import Plan
from dcache.files.atomic import atomic_write_bytes, atomic_write_text, atomic_write_with


def plan() -> Plan:
    return Plan(model_class="FluxTransformer2DModel", block_layout=[2, 3], granularity="stack", units=["stack"],
                num_steps=3, actions={"cond": ["C", "R", "C"]})


def write_everything(out) -> list:
    """Every writer of the project, once, into `out`; returns the files written."""
    from dcache.eval.plots import heatmap
    from dcache.pipelines.images import save_grid, save_video
    from dcache.schedules.calibration_file import CalibrationEntry, save_calibration
    from dcache.schedules.tuning.search.core import FrontPoint, Measured, write_front
    from dcache.files.state_file import save_state

    files = [plan().save(out / "plan.json"), atomic_write_text(out / "stats.json", "{}"),
             atomic_write_bytes(out / "blob.bin", b"\x00\x01"),
             save_calibration(out / "calibration.json", CalibrationEntry("magcache", "id", "FluxTransformer2DModel",
                                                                       {"ratios": [1.0]})),
             save_grid([torch.rand(2, 3, 8, 8)], out / "grid.png"), save_video(torch.rand(3, 3, 8, 8), out / "v.gif"),
             heatmap(torch.rand(4, 5), out / "heat.png", title="t"),
             save_state(out / "state.safetensors", {"x": torch.ones(2), "n": 3}, "test state")]
    write_front(out / "search", "test", [FrontPoint("p0", plan(), Measured(30.0, 0.6))])
    files += sorted(p for p in (out / "search").rglob("*") if p.is_file())
    assert {"front.json", "front.png", "summary.md"} <= {p.name for p in files}
    return files


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o077])
def test_every_output_gets_the_umask_permissions(tmp_path, umask):
    old = os.umask(umask)
    try:
        files = write_everything(tmp_path)
    finally:
        os.umask(old)
    modes = {str(p.relative_to(tmp_path)): oct(stat.S_IMODE(os.stat(p).st_mode)) for p in files}
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes
    assert not [p for p in tmp_path.rglob("*") if ".tmp" in p.name]


@pytest.mark.parametrize("writer", ["text", "with"])
def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path, writer):
    path = tmp_path / "front.png"
    path.write_bytes(b"old")

    def half_then_fail(tmp):
        tmp.write_bytes(b"half")
        raise KeyboardInterrupt

    with pytest.raises((KeyboardInterrupt, TypeError)):
        if writer == "text":
            atomic_write_text(path, b"not text")  # type: ignore[arg-type]
        else:
            atomic_write_with(path, half_then_fail)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["front.png"]
