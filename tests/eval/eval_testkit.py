"""Constants shared by the eval tests (imported as `eval_testkit`; tests/ is on the path)."""

TINY_LABELS = "0,1,2,3"
FAST = dict(steps=4, guidance=1.0, repeats=1, warmup=0)  # 4 transformer calls per generation, no CFG
