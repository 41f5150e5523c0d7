"""benchmarks/profiling/kernel_sass.py compiles the fused codec kernels for sm_90 without a GPU (the
Triton wheel's ptxas/nvdisasm/cuobjdump) and attributes their instructions to source lines."""

import json
import os
import subprocess
import sys

from titan_launch import REPO


def _profile(tmp_path, *flags):
    out = tmp_path / "profile.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(REPO / "benchmarks" / "profiling" / "kernel_sass.py"), *flags,
                          "--json", str(out)], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(out.read_text())


def test_the_encode_kernel_compiles_offline_and_its_dct_is_found(tmp_path):
    res = _profile(tmp_path)
    assert res["instructions"] == sum(res["by_op"].values()) == sum(res["by_line"].values()) > 1000
    assert 0 < res["resources"]["REG"] <= 255
    # The DCT's tensor-core products (Hopper: HGMMA) come from the encode's tl.dot line.
    assert res["by_op"].get("HGMMA", 0) > 0
    dct = [where for where in res["by_line"] if where.startswith("encode.py:")]
    lines = (REPO / "flexdemo" / "kernels" / "encode.py").read_text().splitlines()
    assert any("tl.dot(tl.dot(f1, x" in lines[int(w.split(":")[1]) - 1] for w in dct)


def test_the_hopper_register_ceiling_reaches_the_compiled_encode(tmp_path):
    # common.launch_options (which the script compiles with) caps the encode at
    # HOPPER_MAXNREG["encode"] registers on sm_90: fewer registers than the compiler's own
    # choice (--maxnreg 0), more spills; --maxnreg 128 (launch_options' maxnreg) caps lower.
    from flexdemo.kernels.common import HOPPER_MAXNREG

    ceiling = HOPPER_MAXNREG["encode"]
    free, default = _profile(tmp_path, "--maxnreg", "0"), _profile(tmp_path)
    low = _profile(tmp_path, "--maxnreg", "128")
    assert low["resources"]["REG"] <= 128 < default["resources"]["REG"] <= ceiling < free["resources"]["REG"]
    assert free["resources"]["STACK"] < default["resources"]["STACK"] < low["resources"]["STACK"]


def test_the_mean_decode_compiles_offline_too_under_its_ceiling(tmp_path):
    from flexdemo.kernels.common import HOPPER_MAXNREG

    res = _profile(tmp_path, "--kernel", "mean_decode")
    assert res["by_op"].get("HGMMA", 0) > 0 and any(w.startswith("decode.py:") for w in res["by_line"])
    free = _profile(tmp_path, "--kernel", "mean_decode", "--maxnreg", "0")
    assert res["resources"]["REG"] <= HOPPER_MAXNREG["decode"] < free["resources"]["REG"]
