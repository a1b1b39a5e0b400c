"""The Triton kernels compile for a GPU (sm_90, H100/H200) on this CPU-only machine.

The interpreter runs the kernels' Python, not the compiler, so a kernel could pass every CPU test and
still fail to compile on a GPU. This builds each kernel ahead of time with triton's own compiler and
checks that the aligned bf16 launch (what FLUX/Wan shapes get) uses 128-bit vector loads and stores,
the access width a memory-bound kernel needs to approach peak bandwidth.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


P = "*bf16"
CASES = {
    "axpy": (
        "axpy", "_axpy_kernel",
        dict(y_ptr=P, x_ptr=P, out_ptr=P, alpha_ptr="*fp32", alpha="fp32", row_elems="i32", head_elems="i32",
             start="i32", ALPHA_FROM_PTR="constexpr", BLOCK="constexpr"),
        {"ALPHA_FROM_PTR": True, "BLOCK": 2048},
        ["y_ptr", "x_ptr", "out_ptr", "row_elems", "head_elems", "start"],
    ),
    "residual_capture": (
        "residual_capture", "_residual_capture_kernel",
        dict(out_ptr=P, inp_ptr=P, prev_ptr=P, res_ptr=P, partial_ptr="*fp32", n_rows="i32", D="i32",
             inv_rows="fp32", eps="fp32", HAS_PREV="constexpr", BLOCK_ROWS="constexpr", BLOCK_D="constexpr"),
        {"HAS_PREV": True, "BLOCK_ROWS": 2, "BLOCK_D": 1024},
        ["out_ptr", "inp_ptr", "prev_ptr", "res_ptr", "partial_ptr", "D"],
    ),
    "rel_l1": (
        "relative_l1", "_rel_l1_stats_kernel",
        dict(a_ptr=P, b_ptr=P, partial_ptr="*fp32", n="i32", n_blocks="i32", BLOCK="constexpr"),
        {"BLOCK": 4096},
        ["a_ptr", "b_ptr", "partial_ptr", "n"],
    ),
    "taylor_update": (
        "taylor", "_taylor_update_kernel",
        dict(table_ptr="*fp32", new_ptr=P, n="i32", inv_dist="fp32", N_UPDATES="constexpr", BLOCK="constexpr"),
        {"N_UPDATES": 2, "BLOCK": 2048},
        ["table_ptr", "new_ptr", "n"],
    ),
    "taylor_forecast": (
        "taylor", "_taylor_forecast_kernel",
        dict(table_ptr="*fp32", out_ptr=P, n="i32", coefs=("fp32", "fp32", "fp32"), N_TERMS="constexpr",
             BLOCK="constexpr"),
        {"N_TERMS": 3, "BLOCK": 2048},
        ["table_ptr", "out_ptr", "n"],
    ),
}


# Runs in a fresh process: triton must be imported without TRITON_INTERPRET for its compiler to work
# (its own library functions are built for the interpreter otherwise), and the tests set it.
COMPILE_ALL = """
import importlib, json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

def ptx(module, builder, signature, constexprs, aligned):
    kernel = getattr(importlib.import_module("dcache.kernels." + module), builder)()
    assert isinstance(kernel, JITFunction), type(kernel)
    names = list(signature)
    signature = {k: "constexpr" if k in constexprs else v for k, v in signature.items()}
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in aligned}  # what an aligned launch gets
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]

results = {}
for name, case in json.loads(sys.argv[1]).items():
    case[2] = {k: tuple(v) if isinstance(v, list) else v for k, v in case[2].items()}
    try:
        results[name] = {"ptx": ptx(*case)}
    except Exception:
        results[name] = {"error": traceback.format_exc()}
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def compiled():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    safe = ["-P"] if getattr(sys.flags, "safe_path", False) else []  # as this process: the checkout stays off sys.path
    proc = subprocess.run([sys.executable, *safe, "-c", COMPILE_ALL, json.dumps(CASES)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_compiles_for_sm90_with_vector_access(name, compiled):
    result = compiled[name]
    assert "error" not in result, result.get("error")
    ptx = result["ptx"]
    assert ".entry" in ptx
    assert "ld.global" in ptx and ".v4.b32" in ptx, f"{name}: no 128-bit global loads in the PTX"
