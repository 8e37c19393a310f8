"""One line about this process's CPU Adam: the file it was loaded from, the SIMD flavour the kernel
reports, and the flag DeepSpeed's JIT path would compile it with here (py-cpuinfo, per process).
Run plain and under the deepspeed launcher by tests/e2e/test_no_run_time_build.py."""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from deepspeed.ops.op_builder.cpu import CPUAdamBuilder  # noqa: E402

from ds_greedysnake import deepspeed_compat  # noqa: E402

if __name__ == "__main__":
    kernel = deepspeed_compat.load_native_op("cpu_adam")
    line = "OP_PROBE " + json.dumps({"rank": os.environ.get("RANK"), "file": kernel.__file__,
                                     "flavour": deepspeed_compat.cpu_adam_simd_flavour(),
                                     "jit_flag": CPUAdamBuilder().simd_width()})
    # One write of the whole line: under the launcher both ranks share one pipe, and with unbuffered output
    # print's text and its newline are two writes, which the other rank's line came between once (CI,
    # 2026-12-02). A write under PIPE_BUF bytes to a pipe is atomic.
    os.write(sys.stdout.fileno(), (line + "\n").encode())
