"""What a command's arguments can be checked for before the model loads (loading takes seconds to minutes).

    check_method("magcach", {})                 # ValueError: unknown method, with close matches
    check_method("plan.json", {})               # the file exists and is a dcache plan or a method config
    check_steps(-5)                             # ValueError naming --steps and what it must be

`dcache generate`, `calibrate`, `eval` and `search` call these (and `runner.check_model`, `runner.check_threads`)
first, so a typo fails in a fraction of a second instead of after "loading the model".
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any


def check_steps(steps: int | None, flag: str = "--steps") -> None:
    if steps is not None and steps < 1:
        raise ValueError(f"{flag} {steps} must be >= 1 (denoising steps), e.g. {flag} 28; leave it out for the "
                         f"pipeline's default.")


def is_file_spec(method: str) -> bool:
    """A --cache / --methods value that names a file (as dcache.apply reads it) rather than a method or preset."""
    from dcache.api.setup_file import names_a_file

    return names_a_file(method)


def check_method(method: str, overrides: dict[str, Any], flag: str = "--cache", model: str | None = None) -> None:
    """A method or preset name with its --set fields (dcache.config_for validates both: unknown names and fields get
    close matches, values their allowed range), or a plan / config file that exists and parses. Options of
    dcache.apply itself among the overrides (max_cache_memory, cache_dtype, ...) are left to it. A calibration file
    (--set calibration=FILE) must exist; the error gives the `dcache calibrate` command for `model` that writes it."""
    import dcache

    from dcache.api.setup_file import Setup, setup_file

    setup = setup_file(method)  # a setup file: read and validated (SetupError names the file, field and fix)
    if setup is not None:
        merged = setup.with_overrides(**overrides)
        Setup.from_dict(merged.to_dict(), source=f"{flag} {method!r} with --set {sorted(overrides)}")
        return
    from dcache.api.apply_cache import apply_keywords

    own = apply_keywords()
    fields = {k: v for k, v in overrides.items() if k not in own}
    if not is_file_spec(method):
        config = dcache.config_for(method, **fields)
        calibration = fields.get("calibration")
        if isinstance(calibration, str) and not Path(calibration).is_file():
            on = "" if model in (None, "", "tiny") else f" --model {shlex.quote(model)}"
            raise FileNotFoundError(
                f"--set calibration={calibration}: no such file. Write it once with `dcache calibrate{on} --method "
                f"{config.method} --out {shlex.quote(calibration)}` (it prints how to use it), or leave "
                f"calibration out (the calibration dcache ships for the model, if any).")
        return
    from dcache.files.atomic import read_json
    from dcache.plans.plan import MAX_PLAN_BYTES, PLAN_FORMAT, Plan, PlanError

    path = Path(method)
    if not path.is_file():
        raise FileNotFoundError(f"{flag} {method!r}: the plan/config file does not exist; pass a method name "
                                f"(dcache methods) or the path of a plan (handle.plan().save(path)).")
    data = read_json(path, MAX_PLAN_BYTES, f"{flag} file", "fix it or write it again (handle.plan().save(path), "
                     "config.to_json())", PlanError)
    if isinstance(data, dict) and data.get("format") == PLAN_FORMAT:
        Plan.from_dict(data, source=f"{flag} {method!r}")
        if fields:
            raise ValueError(f"{flag} {method!r} is a plan: it replays fixed decisions, so --set "
                             f"{', '.join(fields)} does not apply; drop --set, or pass a method name to configure.")
    elif isinstance(data, dict) and "method" in data:
        dcache.config_from_dict({**data, **fields})
    else:
        raise PlanError(f"{flag} {method!r} is neither a dcache plan (a JSON object with \"format\": "
                        f"\"{PLAN_FORMAT}\", written by handle.plan().save(path)) nor a method config (a JSON "
                        f"object with \"method\", written by config.to_json()).")
