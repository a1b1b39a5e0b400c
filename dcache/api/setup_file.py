"""Cache setups as files: one validated, versioned JSON (or YAML) object for everything `dcache.apply` takes.

A serving engine or a team keeps its cache configuration beside its model configuration, reviews it and ships it;
`dcache.apply(pipe, "setup.json")`, `dcache generate --cache setup.json` and transformer-only loops read the same
file. Every field is optional except `method`:

    {
      "format": "dcache.setup", "version": 2,
      "method": "magcache",                      # a method or preset name, or a plan / config file (a relative
                                                 # path is read from the setup file's folder)
      "knobs": {"threshold": 0.06},              # the method's config fields (none for a plan file)
      "scope": "blocks",                         # "blocks" | "call" | null (the plan's own, else "blocks")
      "num_steps": null,                         # transformer-only use: the step count
      "memoize": true,
      "decisions": "sample",                     # the default; "batch": one decision per batched call (serving.md)
      "storage": {"dtype": "bfloat16", "scale": null, "device": null},          # dcache.Storage's fields
      "budget": {"max_memory": "8GiB", "fit": "auto"},                          # dcache.Budget's fields
      "models": {"experts": {"transformer_2": {"warmup_steps": 2}},             # dcache.Models's fields: per
                 "controlnet": "follow"}                                        # expert knobs, a method or null
    }

The groups are dcache.apply's (dcache.api.options) and are checked by them. Version 1 files (one "storage" object
with cache_dtype / cache_scale / cache_device / max_cache_memory / fit, and "experts" / "controlnet" at the top)
still load: they are read into the version 2 groups, and their errors name the version 1 fields.
Arguments given to `dcache.apply` beside the file override its fields (per request: `dcache.apply(pipe,
"setup.json", threshold=0.1, scope="call")`; knobs merge into `knobs`). `handle.setup()` gives back the setup a
handle was applied with, so a setting found in Python (or by `speed=` / `quality=`) is saved with
`handle.setup().save("setup.json")`. Files are read with a size cap and `yaml.safe_load` (never pickle); a bad field
is a SetupError naming the file, the field and the fix, before anything is hooked.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from ..files.atomic import atomic_write_text, read_json, read_limited

SETUP_FORMAT = "dcache.setup"
SETUP_VERSION = 2
MAX_SETUP_BYTES = 1 << 20  # a setup is a few hundred bytes; a megabyte is a wrong file, not a setup
SCOPES = ("blocks", "call")
V1_STORAGE = {"cache_dtype": ("storage", "dtype"), "cache_scale": ("storage", "scale"),
              "cache_device": ("storage", "device"), "max_cache_memory": ("budget", "max_memory"),
              "fit": ("budget", "fit")}  # a version 1 file's "storage" fields -> (group, field)
YAML_SUFFIXES = (".yaml", ".yml")
_EXAMPLE = '{"format": "dcache.setup", "version": 1, "method": "magcache", "knobs": {"threshold": 0.06}}'


class SetupError(ValueError):
    """A setup file (or a setup dict) with a missing, unknown or invalid field."""


@dataclass(frozen=True)
class Setup:
    method: str
    knobs: dict[str, Any] = field(default_factory=dict)
    scope: str | None = None
    num_steps: int | None = None
    memoize: bool = True
    decisions: str | None = None  # "sample" | "batch" | None (apply's default)
    storage: dict[str, Any] = field(default_factory=dict)  # dcache.Storage's fields that are set
    budget: dict[str, Any] = field(default_factory=dict)  # dcache.Budget's
    models: dict[str, Any] = field(default_factory=dict)  # dcache.Models's

    # ------------------------------------------------------------------------------------------ reading
    @classmethod
    def from_dict(cls, data: Any, source: str = "setup", folder: Path | None = None) -> "Setup":
        """Validate a setup object; `source` names it in errors, `folder` resolves a relative plan path."""
        fail = _failer(source)
        if not isinstance(data, dict):
            raise fail("", f"is {type(data).__name__}, not a JSON object", f"write one like {_EXAMPLE}")
        if data.get("format") != SETUP_FORMAT:
            raise fail("format", f"is {data.get('format')!r:.60}, not {SETUP_FORMAT!r}",
                       f"a setup file starts {{\"format\": \"{SETUP_FORMAT}\", \"version\": {SETUP_VERSION}, ...}}")
        version = data.get("version")
        if type(version) is not int or version not in (1, SETUP_VERSION):  # noqa: E721 - True == 1 must not pass
            raise fail("version", f"is {version!r:.40}; this dcache reads version 1 or {SETUP_VERSION}",
                       "write the file again with this dcache (handle.setup().save(path)) or use the dcache that "
                       "wrote it")
        if version == 1:
            data, fail = _from_version_1(data, fail)
        known = {f.name for f in fields(cls)} | {"format", "version"}
        unknown = sorted(set(data) - known, key=str)
        if unknown:
            raise fail(str(unknown[0]), "is not a setup field", f"the fields are {sorted(known)}")
        values = {k: v for k, v in data.items() if k not in ("format", "version")}
        if "method" not in values:
            raise fail("method", "is missing", 'name a method, a preset or a plan file, e.g. "method": "magcache"')
        setup = cls(**values)
        setup._check(fail, folder)
        return setup

    def _check(self, fail, folder: Path | None) -> None:
        method, knobs = self.method, self.knobs
        if not isinstance(method, str) or not method:
            raise fail("method", f"is {method!r:.60}", 'give a name or a path as a string, e.g. "magcache"')
        if not isinstance(knobs, dict):
            raise fail("knobs", f"is {type(knobs).__name__}", 'give an object of config fields, e.g. '
                       '{"threshold": 0.06}')
        if names_a_file(method):
            path = resolve_path(method, folder)
            if not path.is_file():
                raise fail("method", f"names the plan/config file {str(path)!r}, which does not exist",
                           "write it with handle.plan().save(path), or give a method name")
            if path.suffix in YAML_SUFFIXES or _format_of(path) == SETUP_FORMAT:
                raise fail("method", f"names another setup file ({str(path)!r})",
                           "a setup names a method, a preset or a plan file; merge the two setups into one")
            if knobs:
                raise fail("knobs", "are given with a plan file", "a plan replays fixed decisions; drop the knobs "
                           "or name a method")
        else:
            from ..methods import config_for

            try:
                config_for(method, **knobs)
            except (ValueError, TypeError) as exc:
                raise fail("method" if "unknown cache method" in str(exc) else "knobs", "is invalid", str(exc)) \
                    from None
        if self.scope not in (None, *SCOPES):
            raise fail("scope", f"is {self.scope!r:.40}", f"use one of {list(SCOPES)} or null")
        steps = self.num_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise fail("num_steps", f"is {steps!r:.40}", "give an int >= 1 (transformer-only use) or null")
        if not isinstance(self.memoize, bool):
            raise fail("memoize", f"is {self.memoize!r:.40}", "give true or false")
        self._check_groups(fail)
        if self.decisions not in (None, "sample", "batch"):
            raise fail("decisions", f"is {self.decisions!r:.40}", 'use "sample" (each sample decided on its own), '
                       '"batch" (one decision per batched call) or null')

    def _check_groups(self, fail) -> None:
        """storage, budget and models: objects of their dcache.api.options group's fields, checked by it."""
        from .options import GROUPS

        for name, group in GROUPS.items():
            value = getattr(self, name)
            names = [f.name for f in fields(group)]
            if not isinstance(value, dict):
                raise fail(name, f"is {type(value).__name__}", f"give an object with some of {names}")
            unknown = sorted(set(value) - set(names), key=str)
            if unknown:
                raise fail(f"{name}.{unknown[0]}", f"is not a {name} field", f"the fields are {names}")
        if self.budget and "max_memory" not in self.budget:
            raise fail("budget.fit", "is given without budget.max_memory",
                       'give the budget too, e.g. "max_memory": "8GiB" (apply\'s max_cache_memory=)')
        if self.budget.get("max_memory") is not None:
            from ..memory.report import parse_bytes

            try:
                parse_bytes(self.budget["max_memory"])
            except (ValueError, TypeError) as exc:
                raise fail("budget.max_memory", "is invalid", str(exc)) from None
        experts = self.models.get("experts")
        if experts is not None:
            if not isinstance(experts, dict):
                raise fail("models.experts", f"is {type(experts).__name__}",
                           'give {"transformer_2": {knobs} | "method" | null}')
            for name, value in experts.items():
                if value is not None and not isinstance(value, (str, dict)):
                    raise fail(f"models.experts.{name}", f"is {type(value).__name__}",
                               "give the expert's knobs as an object, a method name, or null (uncached)")
        controlnet = self.models.get("controlnet")
        if controlnet is not None and not isinstance(controlnet, (str, dict)):
            raise fail("models.controlnet", f"is {type(controlnet).__name__}",
                       'give "follow", a method name, or {"method": "fixed_interval", "interval": 3}')
        for name, group in GROUPS.items():
            if name == "budget" and not self.budget:
                continue  # no budget
            try:
                group(**getattr(self, name))
            except (ValueError, TypeError) as exc:
                raise fail(name, "is invalid", str(exc)) from None

    # ------------------------------------------------------------------------------------------ writing
    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"format": SETUP_FORMAT, "version": SETUP_VERSION}
        for f in fields(self):
            data[f.name] = getattr(self, f.name)
        return data

    def save(self, path: str | os.PathLike) -> Path:
        """Write the setup as JSON (or YAML for *.yaml / *.yml) atomically; returns the path."""
        target = Path(path)
        data = self.to_dict()
        if target.suffix in YAML_SUFFIXES:
            import yaml

            text = yaml.safe_dump(data, sort_keys=False)
        else:
            text = json.dumps(data, indent=1) + "\n"
        return atomic_write_text(target, text)

    def with_overrides(self, **arguments: Any) -> "Setup":
        """This setup with apply's arguments on top: a group object (storage=dcache.Storage(...)) replaces that
        group, a flat shorthand (cache_dtype=, max_cache_memory=, experts=, ...) one field of it, other names that
        are not setup fields merge into `knobs`."""
        from .options import GROUPS, SHORTHANDS

        top = {k: v for k, v in arguments.items() if k in ("scope", "num_steps", "memoize", "decisions")}
        groups = {name: dict(getattr(self, name)) for name in GROUPS}
        knobs = dict(self.knobs)
        for key, value in arguments.items():
            if key in top:
                continue
            if key in GROUPS:
                groups[key] = value.to_dict() if isinstance(value, GROUPS[key]) else dict(value or {})
            elif key in SHORTHANDS:
                group, name = SHORTHANDS[key]
                if value is not None:
                    groups[group][name] = value
            else:
                knobs[key] = value
        return replace(self, **top, knobs=knobs, **groups)

    def apply_arguments(self) -> dict[str, Any]:
        """The keyword arguments of dcache.apply this setup stands for (method included)."""
        from .options import GROUPS

        groups = {name: group(**getattr(self, name)) if getattr(self, name) else None
                  for name, group in GROUPS.items()}
        return {"method": self.method, "scope": self.scope, "num_steps": self.num_steps, "memoize": self.memoize,
                "decisions": self.decisions, **groups, **self.knobs}


def _from_version_1(data: dict, fail: Any) -> tuple[dict, Any]:
    """A version 1 setup as version 2 data, and a `fail` that names its fields as the version 1 file does."""
    data = dict(data)
    storage = data.pop("storage", {})
    if not isinstance(storage, dict):
        raise fail("storage", f"is {type(storage).__name__}", f"give an object with some of {list(V1_STORAGE)}")
    unknown = sorted(set(storage) - set(V1_STORAGE), key=str)
    if unknown:
        raise fail(f"storage.{unknown[0]}", "is not a storage field", f"the fields are {list(V1_STORAGE)}")
    from ..memory.cache_codec import cache_codec

    try:  # checked under the file's own names
        cache_codec(storage.get("cache_dtype"), storage.get("cache_scale"), storage.get("cache_device"))
    except (ValueError, TypeError) as exc:
        raise fail("storage", "is invalid", str(exc)) from None
    groups: dict[str, dict] = {"storage": {}, "budget": {}, "models": {}}
    for key, value in storage.items():
        if value is not None:
            group, name = V1_STORAGE[key]
            groups[group][name] = value
    for key in ("experts", "controlnet"):
        if data.get(key) is not None:
            groups["models"][key] = data[key]
        data.pop(key, None)
    renames = {f"{group}.{name}": f"storage.{key}" for key, (group, name) in V1_STORAGE.items()}
    renames.update({"budget": "storage", "models.experts": "experts", "models.controlnet": "controlnet"})

    def fail_v1(name: str, problem: str, fix: str) -> SetupError:
        for new, old in sorted(renames.items(), key=lambda kv: -len(kv[0])):
            if name == new or name.startswith(new + "."):
                name = old + name[len(new):]
                break
        return fail(name, problem, fix)

    return {**data, **groups}, fail_v1


def names_a_file(method: str) -> bool:
    """True for a method string that is a path (a plan, config or setup file) rather than a method name."""
    return method.endswith((".json", *YAML_SUFFIXES)) or os.path.sep in method or Path(method).is_file()


def resolve_path(text: str, folder: Path | None) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() or folder is None else folder / path


def load_setup(path: str | os.PathLike) -> Setup:
    """Read and validate a setup file (JSON, or YAML for *.yaml / *.yml); a plan path in it is resolved against
    the file's folder."""
    path = Path(path)
    what, fix = "setup file", "fix it or write it again with handle.setup().save(path)"
    if path.suffix in YAML_SUFFIXES:
        import yaml

        text = read_limited(path, MAX_SETUP_BYTES, what, fix, SetupError).decode("utf-8", errors="replace")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise SetupError(f"setup file {str(path)!r} is not valid YAML ({str(exc).splitlines()[0]}); {fix}.") \
                from None
    else:
        data = read_json(path, MAX_SETUP_BYTES, what, fix, SetupError)
    setup = Setup.from_dict(data, source=f"setup file {str(path)!r}", folder=path.parent)
    if names_a_file(setup.method):
        setup = replace(setup, method=str(resolve_path(setup.method, path.parent)))
    return setup


def setup_file(method: Any) -> Setup | None:
    """The Setup a `method=` argument names (a YAML file, or a JSON file whose format is dcache.setup), else None."""
    if not isinstance(method, (str, os.PathLike)):
        return None
    path = Path(method)
    if path.suffix in YAML_SUFFIXES or (path.suffix == ".json" and _format_of(path) == SETUP_FORMAT):
        if not path.is_file():
            raise SetupError(f"setup file {str(path)!r} does not exist; write one with handle.setup().save(path) "
                             f"or like {_EXAMPLE}.")
        return load_setup(path)
    return None


def _format_of(path: Path) -> Any:
    """The "format" of a small JSON file, or None (missing, unreadable or not an object: the plan reader says why)."""
    try:  # read_json's size cap, decoding and nesting checks; its error is the plan reader's to give
        data = read_json(path, MAX_SETUP_BYTES, "setup file", "", SetupError)
    except SetupError:
        return None
    return data.get("format") if isinstance(data, dict) else None


def _failer(source: str):
    def fail(name: str, problem: str, fix: str) -> SetupError:
        where = f"field {name!r} " if name else ""
        return SetupError(f"{source}: {where}{problem}; {fix}.")
    return fail


def setup_of(method: Any, knobs: dict[str, Any], options: Any, *, scope: str | None, num_steps: int | None,
             memoize: bool, decisions: str | None) -> Setup:
    """The Setup that dcache.apply's arguments stand for (a target already resolved to its config); `options`: the
    dcache.api.options.Options apply resolved."""
    from ..config import MethodConfig
    from ..methods import config_for

    knobs = dict(knobs)
    if isinstance(method, MethodConfig):  # a config object, or the one speed= / quality= chose
        defaults = config_for(method.method).to_dict()
        knobs = {**{k: v for k, v in method.to_dict().items() if k not in ("method", "version") and v != defaults[k]},
                 **knobs}
        method = method.method
    elif isinstance(method, (str, os.PathLike)):
        method = str(Path(method).resolve()) if names_a_file(str(method)) else str(method)
    else:
        raise SetupError(f"this handle was applied with a {type(method).__name__} object, which a setup file cannot "
                         f"name; save it as a plan (handle.plan().save('plan.json')) and apply that path, or apply "
                         f"a method name with its knobs.")
    models = options.models
    if any(not isinstance(v, (str, dict)) and v is not None for v in (models.experts or {}).values()) or \
            not isinstance(models.controlnet, (str, dict, type(None))):
        raise SetupError("this handle's experts= or controlnet= holds a config, Plan or Schedule object, which a "
                         "setup file cannot name; give them as method names or knob objects to save the setup.")
    return Setup(method=method, knobs=_plain(knobs), scope=scope, num_steps=num_steps, memoize=memoize,
                 decisions=decisions, storage=options.storage.to_dict(),
                 budget=options.budget.to_dict() if options.budget is not None else {}, models=models.to_dict())


def _plain(value: Any) -> Any:
    """Tuples as lists, so that a setup compares equal to its JSON round trip."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
