"""Offline plan search: every search writes replayable Plans and a Pareto front (JSON + plot + Markdown).

    from dcache.schedules.tuning.search import Calibration, ecad_search, lemica_search, dp_search
    calib = Calibration(pipe, generate=lambda: pipe(...).images, quality_fn=psnr)

Methods: ECAD (NSGA-II over module genomes, checkpoint/resume), LeMiCa (lexicographic-minimax path on the step DAG),
CacheQuant-style DP over step groups, keyframe placement (coordinate ascent, resumable), and learned routers (L2C,
HarmoniCa). This subpackage is imported explicitly (`dcache.schedules` auto-imports its top-level method files only);
it never imports dcache.pipelines or dcache.eval.
"""

from .core import Calibration, FrontPoint, Measured, Template, convert_rows, make_template, measure, run_plan
from .dp import DPConfig, dp_schedule, dp_search
from .ecad import ECADConfig, ecad_search
from .keyframe_search import KeyframeSearchConfig, keyframe_search
from .lemica import LeMiCaConfig, leximax_path, lemica_search
from .scope_choice import choose_scope

__all__ = ["Calibration", "FrontPoint", "Measured", "Template", "convert_rows", "make_template", "measure",
           "run_plan", "ECADConfig", "ecad_search",
           "DPConfig", "dp_schedule", "dp_search", "LeMiCaConfig", "leximax_path", "lemica_search",
           "choose_scope", "KeyframeSearchConfig", "keyframe_search"]
