"""Guards: one import name (`dcache`), and imports that point one way through the layers.

Layers, lowest first: kernels/ (dcache.kernels), dcache/ (the core), schedules/ (dcache.schedules: the runtime
policies), schedules/tuning/ (dcache.schedules.tuning: offline tuning that runs pipelines or models: profiling,
calibration, plan search), pipelines/ (dcache.pipelines), eval/ (dcache.eval), and the command line
(pipelines/cli.py, dcache.pipelines.cli) on top of everything. A file may import its own layer and the layers below;
nothing imports the command line. The layers below tuning import no optional plotting / launching / search package
(matplotlib, accelerate, pymoo, torchmetrics). Imports are read from the syntax tree, including
`importlib.import_module("dcache.x")` / `__import__("dcache.x")` / `require("x")` (dcache/optional_deps.py) calls, so a
dynamic import counts like a static one. The core reaches the method packages through the `dcache.methods` entry
point (dcache/plugins.py), which names no package in code.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAYERS = ["kernels", "dcache", "schedules", "tuning", "pipelines", "eval", "cli"]  # lower first
PACKAGE_OF = {"kernels": "dcache.kernels", "dcache": "dcache", "schedules": "dcache.schedules",
              "tuning": "dcache.schedules.tuning", "pipelines": "dcache.pipelines", "eval": "dcache.eval",
              "cli": "dcache.pipelines.cli"}
FOLDER_OF = {"tuning": Path("schedules/tuning")}  # a layer nested in another's folder; the others: their own name
CLI_FILE = Path("pipelines/cli.py")
MAIN_FILE = Path("dcache/__main__.py")  # `python -m dcache`: the command line's second door, in its layer
# Optional packages of the eval / search extras (dcache/optional_deps.py): only tuning and the layers above import
# them.
OPTIONAL_ABOVE_TUNING = {"matplotlib", "accelerate", "pymoo", "torchmetrics"}
SOURCE_NAMES = ["kernels", "schedules", "pipelines", "eval"]  # source folders, importable only under dcache.


@pytest.mark.slow  # builds and installs a wheel: ~50 s on a busy 2-core CPU
def test_only_dcache_is_importable(tmp_path):
    code = (
        "import importlib, sys\n"
        "import dcache, dcache.kernels, dcache.schedules, dcache.pipelines, dcache.eval\n"
        "bad = []\n"
        f"for name in {SOURCE_NAMES + ['tests']!r}:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "        bad.append(name)\n"
        "    except ModuleNotFoundError:\n"
        "        pass\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"top-level names leak besides dcache: {out.stdout}"


def test_no_source_folder_is_importable_by_its_bare_name_inside_the_suite():
    # Inside the running suite (tests/conftest.py takes the repository root and tests/ off sys.path), a test that
    # wrote `import kernels` or `from schedules import x` must fail as it would for a user of the installed package.
    leaks = {name: str(spec.origin or list(spec.submodule_search_locations or []))
             for name in SOURCE_NAMES if (spec := importlib.util.find_spec(name)) is not None}
    loaded = [name for name in SOURCE_NAMES if name in sys.modules]
    assert not leaks and not loaded, f"top-level import names leak into the test run: {leaks or loaded}"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if rel == CLI_FILE:
        return PACKAGE_OF["cli"]
    parts = [PACKAGE_OF[rel.parts[0]], *rel.parts[1:-1]]
    if path.stem != "__init__":
        parts.append(path.stem)
    return ".".join(parts)


def _dynamic_target(call: ast.Call, module: str) -> str | None:
    """The module named by importlib.import_module("x") / import_module(f"{__name__}.y") / __import__("x") /
    require("x") (dcache.optional_deps: an optional dependency)."""
    func = call.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in {"import_module", "__import__", "require"} or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr):  # the constant prefix, with {__name__} read as this module's name
        text = ""
        for part in arg.values:
            if isinstance(part, ast.Constant):
                text += str(part.value)
            elif isinstance(part.value, ast.Name) and part.value.id == "__name__":
                text += module
            else:
                break
        return text.rstrip(".") or None
    return None


def imports_of(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module a source file imports, statically or through importlib; relative imports resolved."""
    package = module if is_package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this file's package
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                found.add(".".join(base + ([node.module] if node.module else [])))
            elif node.module:
                found.add(node.module)
        elif isinstance(node, ast.Call) and (target := _dynamic_target(node, module)):
            found.add(target)
    return found


def _imports(path: Path) -> set[str]:
    return imports_of(path.read_text(), _module_name(path), path.stem == "__init__")


def _layer_of(module: str) -> str | None:
    for folder, pkg in sorted(PACKAGE_OF.items(), key=lambda kv: -len(kv[1])):
        if module == pkg or module.startswith(pkg + "."):
            return folder
    return None


def _files_of(layer: str) -> list[Path]:
    """The layer's source files: its folder, less the command line files and the folders of layers nested in it."""
    if layer == "cli":
        return [ROOT / CLI_FILE, ROOT / MAIN_FILE]
    folder = FOLDER_OF.get(layer, Path(layer))
    nested = [FOLDER_OF[other] for other in FOLDER_OF if other != layer and FOLDER_OF[other].parts[0] == layer]
    return [path for path in sorted((ROOT / folder).rglob("*.py"))
            if (rel := path.relative_to(ROOT)) not in (CLI_FILE, MAIN_FILE)
            and not any(rel.is_relative_to(n) for n in nested)]


def test_the_import_reader_sees_dynamic_and_relative_imports():
    source = ("import importlib\nfrom . import plan\nfrom ..x import y\n"
              "importlib.import_module('dcache.schedules')\n__import__('dcache.eval.runner')\n"
              "importlib.import_module(f'{__name__}.sub')\nimportlib.import_module(name)\nrequire('matplotlib')\n")
    assert imports_of(source, "dcache.pipelines.mod") == {
        "importlib", "dcache.pipelines", "dcache.x", "dcache.schedules", "dcache.eval.runner",
        "dcache.pipelines.mod.sub", "matplotlib"}


def test_each_source_file_belongs_to_one_layer():
    # schedules/tuning/ is the tuning layer, not part of the schedules layer, and pipelines/cli.py is the cli layer
    files = [path for layer in LAYERS for path in _files_of(layer)]
    assert len(files) == len(set(files)), "a file is counted in two layers"
    every = {path for name in ["kernels", "dcache", "schedules", "pipelines", "eval"]
             for path in (ROOT / name).rglob("*.py")}
    assert set(files) == every
    assert ROOT / "schedules" / "tuning" / "profiling.py" in _files_of("tuning")
    assert not any("tuning" in path.relative_to(ROOT).parts for path in _files_of("schedules"))
    assert _layer_of("dcache.schedules.tuning.search.core") == "tuning" and _layer_of("dcache.schedules.bac") == \
        "schedules"


def _layer_files():
    for layer in LAYERS:
        for path in _files_of(layer):
            rel = path.relative_to(ROOT).as_posix()
            yield pytest.param(layer, path, id=rel)


@pytest.mark.parametrize("layer, path", list(_layer_files()))
def test_imports_point_down_only(layer, path):
    allowed = set(LAYERS[: LAYERS.index(layer) + 1])
    offenders = [f"{path.relative_to(ROOT)} imports {module} ({found} is above {layer})"
                 for module in sorted(_imports(path))
                 if (found := _layer_of(module)) is not None and found not in allowed]
    assert not offenders, "\n".join(offenders)


@pytest.mark.parametrize("layer", LAYERS[: LAYERS.index("tuning")])
def test_layers_below_tuning_import_no_plotting_launching_or_search_package(layer):
    # A runtime policy decides from numbers: plots (matplotlib), multi-process launch (accelerate) and search
    # (pymoo) belong to offline tuning and the layers above it.
    offenders = [f"{path.relative_to(ROOT)} imports {module}" for path in _files_of(layer)
                 for module in _imports(path) if module.split(".")[0] in OPTIONAL_ABOVE_TUNING]
    assert not offenders, "\n".join(offenders)


# Calls that install hooks on modules or tensors, and dcache.apply (running a pipeline with a method applied).
HOOK_CALLS = {"register_forward_hook", "register_forward_pre_hook", "register_full_backward_hook",
              "register_full_backward_pre_hook", "register_hook"}


def _hook_and_apply_calls(source: str) -> list[str]:
    """`x.register_forward_hook(...)`-style calls and `dcache.apply(...)` calls, by line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            if node.func.attr in HOOK_CALLS or (
                    node.func.attr == "apply" and isinstance(owner, ast.Name) and owner.id == "dcache"):
                found.append(f"line {node.lineno}: .{node.func.attr}(...)")
    return found


def test_the_hook_reader_sees_hooks_and_apply():
    source = ("import dcache\nh = block.register_forward_hook(f)\nhandle = dcache.apply(pipe, 'fora')\n"
              "'dcache.apply(pipe)'\nx.apply(f)\n")
    assert _hook_and_apply_calls(source) == ["line 2: .register_forward_hook(...)", "line 3: .apply(...)"]


def test_policies_install_no_hook_and_apply_no_method():
    # A policy sees numbers only: hooks on modules, and runs of a pipeline with dcache applied, are offline tuning.
    offenders = [f"{path.relative_to(ROOT)} {call}" for path in _files_of("schedules")
                 for call in _hook_and_apply_calls(path.read_text())]
    assert not offenders, "\n".join(offenders)


@pytest.mark.slow  # a fresh interpreter importing torch, diffusers and the policies: ~10 s on a busy 2-core CPU
def test_importing_the_policies_loads_no_tuning_module():
    # schedules/__init__.py imports every policy file by name (a dynamic import the syntax-tree reader cannot
    # resolve); it must skip the tuning subpackage, which declares itself under the entry point on its own.
    code = ("import sys\nimport dcache.schedules\n"
            "print(sorted(m for m in sys.modules if m.startswith('dcache.schedules.tuning')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_kernels_import_only_torch_triton_and_stdlib():
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        for module in _imports(path):
            top = module.split(".")[0]
            assert top in {"torch", "triton", "dcache", "__future__"} or top in sys.stdlib_module_names, \
                f"{path.name} imports {module}"


def test_the_package_ships_its_type_marker_and_requires_no_extra():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "dcache" / "py.typed").is_file()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["dcache"]
    required = " ".join(project["project"]["dependencies"])
    for module in ["matplotlib", "torchmetrics", "accelerate", "pymoo", "triton"]:
        assert module not in required, f"{module} is required; it belongs in an extra (dcache/optional_deps.py)"


def test_every_source_package_is_in_the_wheel():
    """A folder with an __init__.py that pyproject.toml does not list is left out of the wheel: an editable install
    (the suite's) still imports it, a plain `pip install` then fails with ImportError at `import dcache.schedules`."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folder_of = {package: Path(folder) for package, folder in setuptools["package-dir"].items()}
    found = set()
    for package, folder in folder_of.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            if "assets" not in relative:
                found.add(".".join((package, *relative)))
    # a sub-folder with its own package-dir entry is that entry's package, named the same either way
    missing = sorted(found - set(setuptools["packages"]))
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}: add them, or the wheel omits them"


@pytest.mark.slow  # a fresh interpreter importing the method packages: ~50 s on a busy 2-core CPU
def test_methods_load_even_when_stale_metadata_comes_first_on_sys_path(tmp_path):
    # A `dcache.egg-info` from an older build left in a checkout's root is the first dcache metadata Python finds
    # when it runs from there; the method packages must still be found through the installed metadata.
    stale = tmp_path / "dcache.egg-info"
    stale.mkdir()
    (stale / "PKG-INFO").write_text("Metadata-Version: 2.1\nName: dcache\nVersion: 0.0.1\n")
    (stale / "entry_points.txt").write_text("[console_scripts]\ndcache = dcache.pipelines.cli:main\n")
    code = (f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
            "import dcache\nprint(len(dcache.methods()))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 10
