"""Compile a fused codec kernel (the encode, or the mean decode) for a GPU architecture offline
(no GPU needed: Triton's own ptxas and nvdisasm) and count its SASS instructions per source line:
where the kernel's instructions are, before spending device time on timing a change.

Static counts: a loop body (the top-k search's rounds, ~4.6 per block) is counted once.
Registers and spills come from cuobjdump. The local Triton may differ from the GPU machines'
(3.6), so compare variants with the same Triton, not these counts with a GPU's.

    python3 benchmarks/profiling/kernel_sass.py                        # 64x64 blocks, k=32, sign, tf32x3
    python3 benchmarks/profiling/kernel_sass.py --precision ieee --top 20 --json out.json
    python3 benchmarks/profiling/kernel_sass.py --kernel mean_decode
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not the CPU interpreter
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9 warns unless it is set
REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

INSTR = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)")
LINE = re.compile(r'//## File "([^"]+)", line (\d+)')


def compile_kernel(kernel: str, arch: int, k: int, precision: str, bracket: bool, warps: int,
                   maxnreg: int | None = None) -> bytes:
    """The per-tensor launch of ``kernel`` for 64x64 blocks (the grouped launches run the same
    block function), compiled for sm_``arch`` with the library's launch options for that
    architecture (common.launch_options: its register ceiling, or ``maxnreg``'s, 0: none),
    ``warps`` warps."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from flexdemo.kernels import decode, encode
    from flexdemo.kernels.common import launch_options, sparse_plan

    blocks = dict(N1=64, N2=64, P1=64, P2=64, K=k)
    plan = sparse_plan(k, 64, 64)
    if kernel == "encode":
        fn = encode._encode_kernel
        sig = {"delta_ptr": "*fp32", "grad_ptr": "*fp32", "skip_ptr": "*fp32", "f1_ptr": "*fp32", "f2_ptr": "*fp32",
               "idx_ptr": "*i32", "vals_ptr": "*fp32", "lr": "fp32", "decay": "fp32", "R": "i32", "C": "i32",
               "blocks_per_row": "i32"}
        consts = dict(**blocks, HAS_GRAD=True, VALUES=0, PREC=precision, **plan, BRACKET=bracket, SKIP_FLAG=True,
                      PARTIAL=False)
    else:
        fn = decode._mean_decode_kernel
        sig = {"param_ptr": "*fp32", "idx_ptr": "*i32", "vals_ptr": "*fp32", "f1_ptr": "*fp32", "f2_ptr": "*fp32",
               "lr": "fp32", "R": "i32", "C": "i32", "blocks_per_row": "i32", "num_blocks": "i32", "W": "i32"}
        consts = dict(**blocks, KP=plan["KP"], KC=plan["KC"], PREC=precision, PARTIAL=False)
    sig.update({name: "constexpr" for name in consts})
    names = list(fn.arg_names)  # constexprs are keyed by their position in the kernel's signature
    assert sorted(names) == sorted(sig), (names, list(sig))
    sig = {name: sig[name] for name in names}
    src = ASTSource(fn, sig, constexprs={(names.index(n),): v for n, v in consts.items()})
    options = {**launch_options("encode" if kernel == "encode" else "decode", 64, 64, divmod(arch, 10),
                                maxnreg=maxnreg),
               "num_warps": warps}
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    return compiled.asm["cubin"]


def profile(cubin: bytes) -> dict:
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tools / "nvdisasm"), "-c", "-g", f.name], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([str(tools / "cuobjdump"), "--dump-resource-usage", f.name], capture_output=True,
                               text=True, check=True).stdout
    by_line, by_op, where = collections.Counter(), collections.Counter(), "?"
    for text in sass.splitlines():
        if m := LINE.search(text):
            where = f"{Path(m[1]).name}:{m[2]}"
        elif m := INSTR.match(text):
            by_line[where] += 1
            by_op[m[1]] += 1
    resources = {k: int(v) for k, v in re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage)}
    return {"instructions": sum(by_op.values()), "resources": resources,
            "by_op": dict(by_op.most_common()), "by_line": dict(by_line.most_common())}


def source_line(where: str) -> str:
    name, _, line = where.partition(":")
    path = REPO / "flexdemo" / "kernels" / name
    return path.read_text().splitlines()[int(line) - 1].strip() if path.is_file() else ""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernel", choices=("encode", "mean_decode"), default="encode")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200)")
    ap.add_argument("--k", type=int, default=32)
    ap.add_argument("--precision", default="tf32x3", choices=("tf32x3", "ieee", "tf32"))
    ap.add_argument("--no-bracket", action="store_true", help="encode: the top-k search from the top bit")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--maxnreg", type=int, default=None,
                    help="a register ceiling, 0 for none (default: the library's for --arch)")
    ap.add_argument("--top", type=int, default=25, help="source lines to list")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    res = profile(compile_kernel(args.kernel, args.arch, args.k, args.precision, not args.no_bracket, args.warps,
                                 args.maxnreg))
    what = f", bracket={not args.no_bracket}" if args.kernel == "encode" else ""
    print(f"{args.kernel} kernel, sm_{args.arch}, k={args.k}, {args.precision}{what}: "
          f"{res['instructions']} SASS instructions, {res['resources']}")
    print("ops:", ", ".join(f"{op} {n}" for op, n in list(res["by_op"].items())[:15]))
    for where, n in list(res["by_line"].items())[:args.top]:
        print(f"{n:6d}  {where:22s} {source_line(where)[:80]}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
