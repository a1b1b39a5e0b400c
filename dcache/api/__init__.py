"""The front door: `dcache.apply`, the handle it returns, setup files, custom loops, experts and ControlNet."""
