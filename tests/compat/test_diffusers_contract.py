"""What dcache assumes of diffusers (and of torch) beyond their public API, checked against the installed versions.

One test per entry of dcache/compat/diffusers.py and dcache/compat/torch.py, named after the assumption: when an
upgrade breaks one, it fails here with a message that names it, before anything downstream misbehaves. Runs in a
few seconds; COMPATIBILITY.md lists the diffusers versions this file passes with.
"""

from __future__ import annotations

import inspect

import diffusers
import torch
from diffusers.hooks import HookRegistry, ModelHook
from torch import nn

from compat_kit import make_transformer
from dcache.compat import diffusers as compat
from dcache.compat.torch import eval_frame_callback


class Doubler(nn.Module):
    def forward(self, hidden_states: torch.Tensor, timestep: float = 0.0) -> torch.Tensor:
        return hidden_states * 2


class ForwardHook(ModelHook):
    """A hook with a `new_forward`, as dcache's unit hooks: it runs what is below it and adds one."""

    def new_forward(self, module, *args, **kwargs):
        return compat.original_forward(self)(*args, **kwargs) + 1


def test_original_forward_is_the_forward_below_a_hook():
    module = Doubler()
    below = module.forward
    hook = ForwardHook()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, "probe")
    assert getattr(hook, "fn_ref", None) is not None, \
        "HookRegistry.register_hook no longer sets hook.fn_ref (dcache.compat.diffusers.original_forward)"
    assert compat.original_forward(hook) == below, \
        "fn_ref.original_forward is not the module's forward before the hook " \
        "(dcache.compat.diffusers.original_forward)"
    assert module(torch.ones(1)).item() == 3, "a hook's new_forward does not replace the module's forward"


def test_a_registered_hook_keeps_the_forward_signature_and_removal_restores_it():
    # dcache finds the timestep argument by the transformer forward's signature, through its hooks
    module = Doubler()
    own = inspect.signature(module.forward)
    registry = HookRegistry.check_if_exists_or_initialize(module)
    assert HookRegistry.check_if_exists_or_initialize(module) is registry, \
        "check_if_exists_or_initialize makes a second registry for one module"
    registry.register_hook(ForwardHook(), "probe")
    assert inspect.signature(module.forward) == own, "register_hook hides the module forward's signature"
    registry.remove_hook("probe", recurse=False)
    assert module(torch.ones(1)).item() == 2, "remove_hook does not restore the forward below the hook"


def test_remove_hook_with_recurse_reaches_submodules():
    outer = nn.Sequential(Doubler(), Doubler())
    for block in outer:
        HookRegistry.check_if_exists_or_initialize(block).register_hook(ForwardHook(), "probe")
    HookRegistry.check_if_exists_or_initialize(outer).remove_hook("probe", recurse=True)
    assert outer(torch.ones(1)).item() == 4, "remove_hook(name, recurse=True) leaves hooks on submodules"


def test_registered_hooks_reads_a_module_registry_by_name():
    module = Doubler()
    assert compat.registered_hooks(module) == {}
    hook = ForwardHook()
    HookRegistry.check_if_exists_or_initialize(module).register_hook(hook, "probe")
    assert compat.registered_hooks(module) == {"probe": hook}, \
        "the hook registry is not at `module._diffusers_hook` with its hooks in `.hooks` by name " \
        "(dcache.compat.diffusers.registered_hooks)"


def test_cache_context_reaches_a_stateful_hook_and_stateful_reset_accepts_it():
    transformer = make_transformer()
    heard = []
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(compat.ContextHook(heard.append), "probe")
    with transformer.cache_context("cond"):
        assert heard == ["cond"], \
            f"cache_context('cond') did not reach the StateManager of a stateful hook (heard {heard}; " \
            f"dcache.compat.diffusers.ContextHook)"
    assert heard == ["cond", None], f"leaving cache_context did not clear the name (heard {heard})"
    HookRegistry.check_if_exists_or_initialize(transformer).reset_stateful_hooks()  # must not raise



def test_cache_context_takes_where_the_loop_is():
    # the bundled pipelines (dcache.pipelines) pass the step to the caches as diffusers' own pipelines do
    transformer = make_transformer()
    heard = []
    HookRegistry.check_if_exists_or_initialize(transformer).register_hook(compat.ContextHook(heard.append), "probe")
    try:
        with transformer.cache_context("cond", step_index=0, num_inference_steps=2, timestep=1.0, sigma=1.0):
            pass
    except TypeError as error:
        raise AssertionError(f"cache_context(name, step_index=, num_inference_steps=, timestep=, sigma=) is refused "
                             f"(diffusers 0.41 and later take them): {error}") from error
    assert heard == ["cond", None]

def test_enable_cache_config_is_visible_while_on():
    from diffusers.hooks import FirstBlockCacheConfig

    transformer = make_transformer()
    assert compat.enabled_cache_config(transformer) is None
    transformer.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    assert isinstance(compat.enabled_cache_config(transformer), FirstBlockCacheConfig), \
        "enable_cache no longer keeps its config in `_cache_config` (dcache.compat.diffusers.enabled_cache_config)"
    assert compat.diffusers_cache(transformer) is not None
    transformer.disable_cache()
    assert compat.enabled_cache_config(transformer) is None, "disable_cache does not reset `_cache_config`"


def test_every_diffusers_cache_defines_its_hooks_in_a_listed_module():
    import diffusers.hooks as hooks

    configs = [getattr(hooks, name) for name in dir(hooks)
               if name.endswith("CacheConfig") or name == "PyramidAttentionBroadcastConfig"]
    sources = {config.__name__: config.__module__.rsplit(".", 1)[-1] for config in configs}
    unlisted = {name: source for name, source in sources.items() if source not in compat.CACHE_HOOK_MODULES}
    assert not unlisted, f"diffusers caches whose hook module is not in CACHE_HOOK_MODULES (dcache would not " \
                         f"refuse to stack on them): {unlisted}"


def test_an_applied_diffusers_cache_is_found_on_the_blocks():
    from diffusers.hooks import FirstBlockCacheConfig, apply_first_block_cache

    transformer = make_transformer()
    apply_first_block_cache(transformer, FirstBlockCacheConfig(threshold=0.1))
    found = compat.diffusers_cache(transformer)
    assert found is not None and "first_block_cache" in found, \
        f"apply_first_block_cache's hooks are not found by their module " \
        f"(dcache.compat.diffusers.diffusers_cache: {found})"


def test_context_parallel_config_keeps_its_mesh_where_dcache_reads_it():
    from diffusers import ContextParallelConfig, ParallelConfig

    assert hasattr(diffusers.ModelMixin, "_parallel_config"), \
        "ModelMixin no longer has `_parallel_config` (dcache.compat.diffusers.context_parallel_mesh)"
    fields = inspect.signature(ParallelConfig).parameters
    assert "context_parallel_config" in fields, "ParallelConfig has no `context_parallel_config`"
    assert "_flattened_mesh" in vars(ContextParallelConfig) or \
        "_flattened_mesh" in getattr(ContextParallelConfig, "__annotations__", {}), \
        "ContextParallelConfig no longer keeps `_flattened_mesh` (dcache.compat.diffusers.context_parallel_mesh)"
    assert compat.context_parallel_mesh(make_transformer()) is None


def test_pipelines_call_their_transformer_from_their_own_method():
    # calling_pipeline walks the frames up to a method whose `self` has this `.transformer` and a `.scheduler`
    from diffusers import FluxPipeline

    source = inspect.getsource(FluxPipeline.__call__)
    assert "self.transformer(" in source and "self.scheduler.step(" in source, \
        "FluxPipeline.__call__ no longer calls self.transformer(...) and self.scheduler.step(...) " \
        "(dcache.compat.diffusers.calling_pipeline)"

    class Pipe:
        def __init__(self, transformer):
            self.transformer, self.scheduler = transformer, object()

        def __call__(self):
            return self.transformer()

    class Probe(nn.Module):
        def forward(self):
            return compat.calling_pipeline(self)

    pipe = Pipe(Probe())
    assert pipe() is pipe
    assert Probe()() is None


def test_source_analysis_reads_every_family_block_list_from_the_diffusers_source():
    # dcache.model.families.source_analysis: `self.<list> = nn.ModuleList([...Block(...)...])` in the class source,
    # block classes defined in a diffusers module; read at run time by generic discovery's refusals
    import diffusers.models.transformers as transformers

    from dcache.model.families import registered_adapters
    from dcache.model.families.source_analysis import static_lists

    missed = {}
    for name, adapter in registered_adapters().items():
        cls = getattr(transformers, name, None) or getattr(diffusers, name, None)
        if cls is None:
            continue  # a family of a newer diffusers: never looked up under this one
        found = {spec.path for spec in static_lists(cls)}
        want = {block_list.path for block_list in adapter.block_lists}
        if not want <= found:
            missed[name] = sorted(want - found)
    assert not missed, f"the source analysis no longer finds these block lists in the class source: {missed}"


def test_eval_frame_callback_tells_a_compiled_region_in_a_skipped_frame():
    seen = []

    @torch.compiler.disable(recursive=False)
    def probe(x):
        seen.append(eval_frame_callback() is not None)
        return x

    def region(x):
        return probe(x + 1) * 2

    probe(torch.ones(1))
    assert seen == [False], "eval_frame_callback() is set in plain eager code (dcache.compat.torch)"
    torch.compile(region, backend="eager")(torch.ones(1))
    assert seen[1:] == [True], \
        "eval_frame_callback() is None in a frame torch.compile skips inside a compiled region (dcache.compat.torch)"



def test_from_pretrained_records_where_a_model_was_loaded_from(tmp_path):
    model = make_transformer()
    assert compat.loaded_from(model) is None, "a model built in code has a _name_or_path (compat.loaded_from)"
    model.save_pretrained(tmp_path / "transformer")
    loaded = type(model).from_pretrained(str(tmp_path / "transformer"))
    assert compat.loaded_from(loaded) == str(tmp_path / "transformer"), \
        "from_pretrained no longer records its path in config._name_or_path (dcache.compat.diffusers.loaded_from)"


def test_qwen_image_blocks_modulate_with_shift_scale_and_gate():
    torch.manual_seed(0)
    block = diffusers.models.transformers.transformer_qwenimage.QwenImageTransformerBlock(
        dim=32, num_attention_heads=2, attention_head_dim=16)
    x, params = torch.randn(2, 5, 32), torch.randn(2, 3 * 32)
    shift, scale, gate = params.chunk(3, dim=-1)
    out = compat.qwen_image_modulate(block, x, params)
    assert isinstance(out, tuple) and len(out) == 2, \
        "QwenImageTransformerBlock._modulate no longer returns (modulated, gate) (compat.qwen_image_modulate)"
    torch.testing.assert_close(out[0], x * (1 + scale[:, None]) + shift[:, None], msg=lambda m: (
        f"QwenImageTransformerBlock._modulate is no longer x * (1 + scale) + shift "
        f"(dcache.compat.diffusers.qwen_image_modulate): {m}"))
    torch.testing.assert_close(out[1], gate[:, None])
