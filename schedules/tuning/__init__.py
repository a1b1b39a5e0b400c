"""Offline tuning: the code that runs a pipeline or model to produce what a runtime policy reads.

Profiling sessions (profiling.py), per-method calibration, the calibrate command's runner and the plan searches
live here, one layer above the runtime policies (`dcache.schedules.<method>`: a frozen config and a Schedule that
decides from numbers only). Tuning may import the policies and the core; no policy imports tuning.
"""
