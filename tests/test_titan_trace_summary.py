"""benchmarks/profiling/trace_summary.py on a hand-made trace whose numbers are known: kernels on two
streams (overlapping), one launched from inside Optimizer.step, one launched in the next step."""

import json
import sys

from titan_launch import REPO

sys.path.insert(0, str(REPO / "benchmarks" / "profiling"))
import trace_summary as tts  # noqa: E402


def _trace(tmp_path):
    ev = [{"ph": "X", "name": "ProfilerStep#5", "cat": "user_annotation", "ts": 0, "dur": 1000},
          {"ph": "X", "name": "ProfilerStep#6", "cat": "user_annotation", "ts": 1000, "dur": 1000},
          {"ph": "X", "name": "Optimizer.step#DeMo.step", "cat": "cpu_op", "ts": 600, "dur": 300},
          # the GPU timeline's copy of an annotation is not a step of its own
          {"ph": "X", "name": "ProfilerStep#5", "cat": "gpu_user_annotation", "ts": 50, "dur": 2000}]
    # (correlation, launch ts, kernel start, kernel end, name)
    for corr, launch, s, e, name in [(1, 10, 100, 300, "gemm"), (2, 20, 200, 400, "gemm"),  # overlap: busy 300
                                     (3, 700, 600, 650, "encode"), (4, 710, 900, 1000, "decode"),
                                     (5, 1010, 1100, 1200, "gemm")]:
        api = "cuda_driver" if name == "encode" else "cuda_runtime"  # Triton launches by the driver API
        ev.append({"ph": "X", "cat": api, "name": "cudaLaunchKernel", "ts": launch, "dur": 5,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": s, "dur": e - s, "args": {"correlation": corr}})
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    return str(path)


def test_busy_union_counts_overlap_once():
    assert tts.busy_union([(0, 10), (5, 15), (20, 30), (21, 22)]) == 25


def test_a_step_summary_has_the_known_numbers(tmp_path):
    text = tts.summarize(_trace(tmp_path), top=5, gaps=5)
    step5 = text.split("### ProfilerStep#5")[1].split("### ProfilerStep#6")[0]
    # Step 5 launched kernels 1-4: GPU span 100..1000 = 0.9 ms, busy 300 + 50 + 100 us.
    assert "GPU span 0.90 ms, busy 0.45 ms, idle 0.45 ms; 4 kernels" in step5
    assert "optimizer: 2 kernels, busy 0.15 ms over a GPU span of 0.40 ms; CPU time in Optimizer.step 0.30 ms" in step5
    assert "| 0.250 | encode | decode |" in step5 and "| 0.200 | gemm | encode |" in step5
    assert "| gemm | 0.40 | 2 |  |" in step5 and "| decode | 0.10 | 1 | yes |" in step5
    assert "1 kernels" in text.split("### ProfilerStep#6")[1] and text.count("### ProfilerStep#5") == 1
