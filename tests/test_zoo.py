"""Every family adapter in dcache/model/families/, checked against a real forward of its tiny zoo model.

Plain forward hooks on every block record what the block is really called with and what it returns; the adapter's
data (argument names, returned slot order, block order, module units, modulated input) must agree with that record.
"""

from __future__ import annotations

import importlib.util
import inspect
import pathlib
import sys
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import pytest
import torch
from torch import nn

from dcache.model.adapters import ENCODER, HIDDEN
from dcache.model import families
from dcache.model.families import adapter_for, registered_adapters


def _load_zoo():
    # tests/ is not a package under --import-mode=importlib: load tests/zoo.py by path, once per process.
    if "dcache_test_zoo" not in sys.modules:
        spec = importlib.util.spec_from_file_location("dcache_test_zoo", pathlib.Path(__file__).with_name("zoo.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return sys.modules["dcache_test_zoo"]


zoo = _load_zoo()
NAMES = sorted(zoo.ZOO)
BATCH = 2  # catches modulated inputs / slots that lose or mix the batch dim


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Zoo models are tiny: torch's intra-op thread pool costs more than it saves, and on a shared CPU its spinning
    # threads make each forward ~10x slower. Restored afterwards for the rest of the session.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@lru_cache(maxsize=None)
def _model(name: str) -> nn.Module:
    return zoo.ZOO[name].make_model()


def _sample(output: Any) -> torch.Tensor:
    """The model's prediction as one tensor (diffusers outputs, tuples, Z-Image's list of per-sample tensors)."""
    sample = output.sample if hasattr(output, "sample") else output[0] if isinstance(output, tuple) else output
    return torch.stack(sample) if isinstance(sample, list) else sample


def _forward(name: str, step: int = 0, batch: int = BATCH, generator=None) -> torch.Tensor:
    with torch.no_grad():
        return _sample(_model(name)(**zoo.ZOO[name].make_inputs(step, batch=batch, generator=generator)))


def _rel_l1(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a - ref).abs().mean() / ref.abs().mean()).item()


def _resolve(root: nn.Module, dotted: str) -> nn.Module | None:
    obj: Any = root
    for part in dotted.split("."):
        obj = getattr(obj, part, None)
    return obj if isinstance(obj, nn.Module) else None


@dataclass
class BlockCall:
    list_index: int
    block_index: int
    arguments: dict[str, Any]  # bound forward arguments, as passed (no defaults filled in)
    output: Any = None
    module_calls: dict[str, int] = field(default_factory=dict)


def _record(name: str, step: int = 0) -> tuple[Any, list[BlockCall], Any]:
    """One forward of the zoo model with hooks on every adapter block (and on its module units)."""
    model, adapter = _model(name), adapter_for(_model(name))
    calls: list[BlockCall] = []
    handles = []
    for list_index, spec in enumerate(adapter.block_lists):
        for block_index, block in enumerate(_resolve(model, spec.path)):
            signature = inspect.signature(block.forward)

            def pre_hook(module, args, kwargs, list_index=list_index, block_index=block_index, signature=signature):
                bound = signature.bind(*args, **kwargs)  # positional calls are mapped to their names here
                calls.append(BlockCall(list_index, block_index, dict(bound.arguments)))

            def post_hook(module, args, kwargs, output):
                calls[-1].output = output

            handles.append(block.register_forward_pre_hook(pre_hook, with_kwargs=True))
            handles.append(block.register_forward_hook(post_hook, with_kwargs=True))
            for unit in adapter.modules:
                inner = _resolve(block, unit)
                if inner is not None:
                    def count(module, args, output, unit=unit):
                        calls[-1].module_calls[unit] = calls[-1].module_calls.get(unit, 0) + 1

                    handles.append(inner.register_forward_hook(count))
    try:
        with torch.no_grad():
            output = model(**zoo.ZOO[name].make_inputs(step, batch=BATCH))
    finally:
        for handle in handles:
            handle.remove()
    return adapter, calls, output


@pytest.fixture(scope="module")
def recorded():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = _record(name)
        return cache[name]

    return get


# ---- the zoo itself ---------------------------------------------------------------------------------------------

def test_every_builtin_family_has_a_zoo_entry():
    import diffusers.models.transformers as transformers

    builtin = {cls for cls in registered_adapters() if hasattr(transformers, cls)}
    zoo_classes = {entry.model_class for entry in zoo.ZOO.values()}
    assert builtin - zoo_classes == set(), f"families without a tiny model in tests/zoo.py: {builtin - zoo_classes}"
    assert zoo_classes - builtin == set(), (f"zoo entries without an adapter in dcache/model/families/: "
                                            f"{zoo_classes - builtin}")
    assert len(zoo_classes) >= 22


def test_every_family_file_is_listed_and_has_tiny_models():
    shared = {"__init__", "patterns", "tiny", "source_analysis"}  # the lookup and what the family files share
    folder = pathlib.Path(families.__file__).parent
    assert sorted(p.stem for p in folder.glob("*.py") if p.stem not in shared) == list(families.FAMILY_MODULES), (
        "every family file in dcache/model/families/ is listed in FAMILY_MODULES (alphabetically), and only those")
    for module in families.family_modules():
        assert module.TINY, f"{module.__name__} has no tiny test model (TINY)"


@pytest.mark.parametrize("name", NAMES)
def test_builds_tiny_and_forwards_finite(name):
    model = _model(name)
    assert type(model).__name__ == zoo.ZOO[name].model_class
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) < 5_000_000, "keep zoo models tiny"
    out = _forward(name)
    assert out.shape[0] == BATCH and torch.isfinite(out).all()


@pytest.mark.parametrize("name", NAMES)
def test_inputs_are_deterministic_and_step_to_step_similar(name):
    entry = zoo.ZOO[name]
    a, b = entry.make_inputs(3, batch=BATCH), entry.make_inputs(3, batch=BATCH)
    for key, value in a.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, b[key]), f"{name}: make_inputs is not deterministic in {key!r}"
    one = entry.make_inputs(3, batch=1)
    main = next(k for k, v in one.items() if isinstance(v, (torch.Tensor, list)))  # the latents come first
    first = lambda v: v[0] if isinstance(v, list) else v[:1]  # noqa: E731
    assert torch.equal(torch.as_tensor(first(a[main])), torch.as_tensor(first(one[main]))), \
        f"{name}: sample 0 of a batch must not depend on the batch size"

    out0, out1 = _forward(name, step=0), _forward(name, step=1)
    other = _forward(name, step=0, generator=torch.Generator().manual_seed(1))
    step_change, sample_change = _rel_l1(out1, out0), _rel_l1(other, out0)
    assert 0.0 < step_change < 0.5 * sample_change, (
        f"{name}: consecutive steps should give close outputs (relL1 {step_change:.3g}) compared to another "
        f"sample (relL1 {sample_change:.3g})")


# ---- adapter data against reality ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_adapter_for_returns_the_family_adapter(name):
    model = _model(name)
    adapter = adapter_for(model)
    assert adapter is registered_adapters()[zoo.ZOO[name].model_class]
    assert adapter.notes != "generic discovery"
    for spec in adapter.block_lists:
        blocks = _resolve(model, spec.path)
        assert isinstance(blocks, nn.ModuleList) and len(blocks) >= 2, f"{name}: {spec.path} needs >= 2 blocks"


@pytest.mark.parametrize("name", NAMES)
def test_blocks_run_once_each_in_adapter_order(name, recorded):
    adapter, calls, _ = recorded(name)
    order = [(c.list_index, c.block_index) for c in calls]
    expected = [(i, j) for i, spec in enumerate(adapter.block_lists)
                for j in range(len(_resolve(_model(name), spec.path)))]
    assert order == expected, f"{name}: blocks ran as {order}, adapter order is {expected}"


@pytest.mark.parametrize("name", NAMES)
def test_stream_arguments_and_returned_slots_match(name, recorded):
    adapter, calls, _ = recorded(name)
    for spec_index, spec in enumerate(adapter.block_lists):
        list_calls = [c for c in calls if c.list_index == spec_index]
        encoder_returned = 0
        for call in list_calls:
            where = f"{name}: {spec.path}[{call.block_index}]"
            hidden = call.arguments.get(spec.hidden)
            assert isinstance(hidden, torch.Tensor), f"{where} was not called with a tensor `{spec.hidden}`"
            assert hidden.shape[0] == BATCH, f"{where}: `{spec.hidden}` has no batch dim first: {tuple(hidden.shape)}"
            out = call.output
            if len(spec.outputs) == 1:
                assert isinstance(out, torch.Tensor), f"{where} returns {type(out).__name__}, adapter says one tensor"
                slots = {spec.outputs[0]: out}
            else:
                assert isinstance(out, tuple) and len(out) == len(spec.outputs), \
                    f"{where} returns {type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}, " \
                    f"adapter says {spec.outputs}"
                slots = {slot: value for slot, value in zip(spec.outputs, out) if slot is not None}
            assert slots[HIDDEN].shape == hidden.shape, \
                f"{where}: returned {HIDDEN} {tuple(slots[HIDDEN].shape)} != input {tuple(hidden.shape)}"
            if spec.encoder is None:
                assert ENCODER not in slots, f"{where}: outputs name {ENCODER} but `encoder` is None"
                continue
            assert ENCODER in slots, f"{where}: `encoder` is {spec.encoder!r} but outputs {spec.outputs} do not " \
                f"return it; a text context the block only reads is not a stream: set encoder=None"
            encoder = call.arguments.get(spec.encoder)
            assert isinstance(encoder, torch.Tensor), f"{where} was not called with a tensor `{spec.encoder}`"
            returned = slots[ENCODER]
            if returned is not None:  # SD3's context_pre_only last block returns None for the text stream
                assert returned.shape == encoder.shape, \
                    f"{where}: returned {ENCODER} {tuple(returned.shape)} != input {tuple(encoder.shape)}"
                encoder_returned += 1
        if spec.encoder is not None:
            assert encoder_returned >= len(list_calls) - 1, f"{name}: {spec.path} does not return its text stream"


@pytest.mark.parametrize("name", NAMES)
def test_module_units_exist_and_run_once_per_block(name, recorded):
    """Every module unit runs once per block call, except those the adapter declares `shared` (called several times
    with one cache per call): they must run more than once, else the declaration is wrong."""
    adapter, calls, _ = recorded(name)
    model = _model(name)
    for unit in adapter.modules:
        found = [c for c in calls if _resolve(_resolve(model, adapter.block_lists[c.list_index].path)[c.block_index],
                                              unit) is not None]
        assert found, f"{name}: module unit {unit!r} exists on no block"
        for call in found:
            runs = call.module_calls.get(unit, 0)
            where = f"{name}: {adapter.block_lists[call.list_index].path}[{call.block_index}].{unit} ran {runs} times"
            if unit in adapter.shared:
                assert runs >= 1, f"{where} in one block call"
            else:
                assert runs == 1, f"{where} in one block call; a module unit must run exactly once (or be declared " \
                                  f"in the adapter's `shared` modules)"


@pytest.mark.parametrize("name", [n for n in NAMES if registered_adapters()[zoo.ZOO[n].model_class].modulated_input])
def test_modulated_input_is_finite_batched_and_tracks_the_step(name):
    model = _model(name)
    adapter = adapter_for(model)
    first = adapter.blocks(model)[0][1]
    signature = inspect.signature(first.forward)
    seen: list[torch.Tensor] = []

    def pre_hook(module, args, kwargs):
        seen.append(adapter.modulated_input(module, dict(signature.bind(*args, **kwargs).arguments)))

    handle = first.register_forward_pre_hook(pre_hook, with_kwargs=True)
    try:
        out0, out1 = _forward(name, step=0), _forward(name, step=1)
    finally:
        handle.remove()
    assert torch.isfinite(out0).all() and torch.isfinite(out1).all()
    m0, m1 = seen
    assert isinstance(m0, torch.Tensor) and torch.isfinite(m0).all()
    assert m0.shape[0] == BATCH, f"{name}: modulated input {tuple(m0.shape)} lost the batch dim"
    assert 0.0 < _rel_l1(m1, m0) < 1.0, f"{name}: modulated input should change a little between steps"


# ---- the support table ----------------------------------------------------------------------------------------------

def test_support_table_covers_every_transformer_class_and_matches_support_md():
    from dcache.model import support_matrix

    rows = support_matrix.support_table()
    classes = support_matrix.transformer_classes()
    assert [r.model_class for r in rows] == list(classes)
    assert {r.status for r in rows} <= {support_matrix.SUPPORTED, support_matrix.GENERIC, support_matrix.NOT_YET}
    supported = {r.model_class for r in rows if r.status == support_matrix.SUPPORTED}
    assert supported == {entry.model_class for entry in zoo.ZOO.values()}
    assert all(r.detail for r in rows if r.status != support_matrix.SUPPORTED), \
        "every non-supported row needs a reason"
    support_md = pathlib.Path(__file__).resolve().parents[1] / "SUPPORT.md"
    assert support_md.read_text() == support_matrix.render_markdown(), \
        "SUPPORT.md is stale: regenerate it with `python -m dcache.model.support_matrix > SUPPORT.md`"


# ---- module units: what they cover, and what a composed unit reads ----------------------------------------------

# Families whose module units cannot cover the block: a module the block calls twice is not a unit.
PARTIAL_MODULE_COVERAGE = {
    "CogView4Transformer2DModel": "`ff` runs twice per block (image, then text)",
    "EasyAnimateTransformer3DModel": "`ff` runs twice per block in the blocks without `txt_ff`",
}
MIN_MODULE_COVERAGE = 0.85  # the rest: AdaLN linears on the (per-sample) timestep embedding, norms, RoPE


def _block_and_unit_flops(name: str) -> dict[int, tuple[float, float, str]]:
    """Per block list: (FLOPs of its first block, FLOPs inside that block's module units, the list path)."""
    from torch.utils.flop_counter import FlopCounterMode

    model, adapter = _model(name), adapter_for(_model(name))
    first = {}
    for list_index, block in adapter.blocks(model):
        first.setdefault(list_index, block)
    counters: dict[str, FlopCounterMode] = {}
    handles = []

    def enter(key):
        def pre(module, args, kwargs):
            counters[key] = FlopCounterMode(display=False)
            counters[key].__enter__()
        return pre

    def leave(key):
        def post(module, args, kwargs, output):
            counters[key].__exit__(None, None, None)
        return post

    for list_index, block in first.items():
        targets = [(f"{list_index}", block)] + [(f"{list_index}.{m}", _resolve(block, m))
                                                for m in adapter.module_names(block)]
        for key, module in targets:
            handles.append(module.register_forward_pre_hook(enter(key), with_kwargs=True))
            handles.append(module.register_forward_hook(leave(key), with_kwargs=True))
    try:
        with torch.no_grad():
            model(**zoo.ZOO[name].make_inputs(0, batch=BATCH))
    finally:
        for handle in handles:
            handle.remove()
    result = {}
    for list_index, block in first.items():
        total = counters[f"{list_index}"].get_total_flops()
        units = sum(counters[f"{list_index}.{m}"].get_total_flops() for m in adapter.module_names(block))
        result[list_index] = (float(total), float(units), adapter.block_lists[list_index].path)
    return result


@pytest.mark.parametrize("name", NAMES)
def test_module_units_cover_the_blocks_flops(name):
    """Module-level methods can only skip what the units cover: a large linear layer left out of `modules` (e.g. a
    Flux single block's proj_out, 38% of its FLOPs) puts a floor under every module method's compute ratio."""
    model_class = zoo.ZOO[name].model_class
    if model_class in PARTIAL_MODULE_COVERAGE:
        pytest.skip(PARTIAL_MODULE_COVERAGE[model_class])
    for total, units, path in _block_and_unit_flops(name).values():
        assert total > 0 and units / total >= MIN_MODULE_COVERAGE, (
            f"{name}: the module units {adapter_for(_model(name)).modules} cover {units / total:.0%} of the FLOPs of "
            f"a {path} block; add its large inner modules to the adapter's `modules` (and to `composed` when a "
            f"module's input is made of other units' outputs)")


COMPOSED = [(n, unit, inputs) for n in NAMES
            for unit, inputs in registered_adapters()[zoo.ZOO[n].model_class].composed]


def test_composed_units_are_declared_where_they_exist():
    assert {n for n, _, _ in COMPOSED} >= {"flux", "chroma", "hunyuan_video", "hunyuan_image", "prx"}


@pytest.mark.parametrize("name, unit, inputs", COMPOSED, ids=[f"{n}-{u}" for n, u, _ in COMPOSED])
def test_composed_unit_reads_only_its_input_units(name, unit, inputs):
    """Adapter.composed claims that `unit`'s input is a function of the `inputs` units' outputs alone (so the
    engine may skip those when `unit` is reused). Check: run a step-1 forward with the inputs' outputs replaced by
    their step-0 values; `unit` must then receive exactly its step-0 input."""
    model, adapter = _model(name), adapter_for(_model(name))
    blocks = [b for _, b in adapter.blocks(model) if unit in adapter.module_names(b)
              and all(m in adapter.module_names(b) for m in inputs)]
    assert blocks, f"{name}: no block has {unit} and {inputs}"
    block = blocks[0]
    seen: dict[str, list] = {"feeds": [], "unit_in": []}
    replay: list | None = None

    def feed_hook(module, args, output):
        if replay is not None:
            return replay.pop(0)
        seen["feeds"].append(output)

    def unit_hook(module, args):
        seen["unit_in"].append([a.clone() for a in args if isinstance(a, torch.Tensor)])

    handles = [_resolve(block, m).register_forward_hook(feed_hook) for m in inputs]
    handles.append(_resolve(block, unit).register_forward_pre_hook(unit_hook))
    try:
        with torch.no_grad():
            model(**zoo.ZOO[name].make_inputs(0, batch=BATCH))
            step0_feeds = list(seen["feeds"][:len(inputs)])  # the hooked block runs once per forward
            replay = list(step0_feeds)
            model(**zoo.ZOO[name].make_inputs(1, batch=BATCH))
    finally:
        for handle in handles:
            handle.remove()
    first, second = seen["unit_in"][0], seen["unit_in"][1]
    assert len(first) == len(second) >= 1
    for a, b in zip(first, second):
        torch.testing.assert_close(b, a, rtol=0, atol=0,
                                   msg=f"{name}: {unit} read something besides the outputs of {inputs}")


# ---- latents for SeaCache's spectral indicator ------------------------------------------------------------------

NO_LATENT_GRID = {  # compared unfiltered (dcache.runtime.latents): no [B, C, T, H, W] layout of the input is known
    "StableAudioDiTModel": "1-D audio latents",
}


@pytest.mark.parametrize("name", NAMES)
def test_call_latents_are_a_5d_relayout_of_the_input(name):
    from dcache.runtime import latents as layouts
    from dcache.runtime.block_io import bind_arguments

    model, adapter = _model(name), adapter_for(_model(name))
    arguments = bind_arguments(model, (), zoo.ZOO[name].make_inputs(0, batch=BATCH))
    hidden = arguments.get("hidden_states")
    if hidden is None and isinstance(arguments.get("x"), list):  # Z-Image: a list of per-sample latents
        hidden = torch.stack(arguments["x"])
    latents = layouts.call_latents(hidden, adapter.latents, arguments)
    if zoo.ZOO[name].model_class in NO_LATENT_GRID:
        assert latents is None
        return
    assert latents is not None, f"{name}: give the adapter a `latents` function ([B, C, T, H, W] of the input)"
    assert latents.ndim == 5 and latents.shape[0] == BATCH and latents.shape[-1] >= 4 and latents.shape[-2] >= 4
    assert latents.numel() == hidden.numel(), f"{name}: {tuple(hidden.shape)} -> {tuple(latents.shape)} lost data"
    assert torch.equal(latents.flatten().sort().values, hidden.flatten().sort().values)  # a re-layout only
