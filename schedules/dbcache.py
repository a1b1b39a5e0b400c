"""DBCache presets (cache-dit "Dual Block Cache", github.com/vipshop/cache-dit) on top of the FBCache schedule.

DBCache is FBCache with Fn > 1 probe blocks (a steadier diff signal than one block), Bn tail blocks that always run
on the approximated state (an "auto-scaler" that restores texture), warm-up steps and a cap on consecutive reuse.
Labels read F{Fn}B{Bn}_W{warmup}MC{max continuous cached}_R{threshold}; cache-dit's MC0 means "no cap" (-1 here).
cache-dit's warm-up skips caching while step <= W; here steps < warmup_steps compute (W8 -> warmup_steps=8).

On small models the Fn / Bn of a preset may leave nothing to cache; `FBCacheConfig.build` then scales them to fit
half of the stack (F8B0 -> F2B0 on the 5-block tiny FLUX model); see schedules/fbcache.py.
Speed-ups quoted are TFLOPs ratios on FLUX.1-dev, 50 steps ([CD] bench/cache/README.md).
"""

from __future__ import annotations

from dcache import register_preset

register_preset("dbcache", "fbcache", "cache-dit default F8B0_W8_R0.08", probe_blocks=8, tail_blocks=0,
                warmup_steps=8, max_continuous_cached=-1, threshold=0.08)
register_preset("dbcache-slow", "fbcache", "F8B0_W4MC0_R0.08: 1.80x, PSNR 33.8 on FLUX.1-dev", probe_blocks=8,
                tail_blocks=0, warmup_steps=4, max_continuous_cached=-1, threshold=0.08)
register_preset("dbcache-medium", "fbcache", "F8B0_W4MC3_R0.12: 2.05x, PSNR 32.5", probe_blocks=8, tail_blocks=0,
                warmup_steps=4, max_continuous_cached=3, threshold=0.12)
register_preset("dbcache-fast", "fbcache", "F4B0_W4MC4_R0.12: 2.66x, PSNR 31.5", probe_blocks=4, tail_blocks=0,
                warmup_steps=4, max_continuous_cached=4, threshold=0.12)
register_preset("dbcache-f8b8", "fbcache", "F8B8_W8_R0.15: tail blocks correct the reused state", probe_blocks=8,
                tail_blocks=8, warmup_steps=8, max_continuous_cached=-1, threshold=0.15)
register_preset("dbcache-m", "fbcache", "FoCa-table DBCache(M) F1B0_W4MC6_R0.24: 3.94x, ImageReward 1.00",
                probe_blocks=1, tail_blocks=0, warmup_steps=4, max_continuous_cached=6, threshold=0.24)
register_preset("fbcache-slow", "fbcache", "FBCache threshold 0.05 (diffusers' FirstBlockCache default)",
                threshold=0.05)
register_preset("fbcache-fast", "fbcache", "FBCache threshold 0.12 (ParaAttention: 13.78 s vs 26.36 s on FLUX, L20)",
                threshold=0.12)
