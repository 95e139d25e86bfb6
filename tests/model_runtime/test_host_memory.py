"""glibc's fixed mmap threshold (model_runtime.host_memory): passes of ever-changing
widths must not grow a worker's resident memory."""

from __future__ import annotations

import subprocess
import sys

PASSES = """
import sys
import torch
from model_runtime.host_memory import fix_mmap_threshold
if sys.argv[1] == "fixed":
    assert fix_mmap_threshold()
torch.set_num_threads(1)
torch.manual_seed(0)
def resident_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
# SmolLM2-135M's linear shapes, the output layer's last: megabytes of logits a pass.
linears = [torch.nn.Linear(i, o, bias=False) for i, o in ((576, 576), (576, 192), (576, 1536), (1536, 576),
                                                          (576, 49152))]
with torch.inference_mode():
    for linear in linears:
        linear(torch.randn(100, linear.in_features))
    start = resident_mib()
    for sweep in range(2):
        for rows in range(1, 101):
            for linear in linears:
                linear(torch.randn(rows, linear.in_features))
    print(resident_mib() - start)
"""


def _growth_mib(mode: str) -> float:
    done = subprocess.run(
        [sys.executable, "-c", PASSES, mode],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return float(done.stdout.strip())


def test_passes_of_every_width_leave_resident_memory_flat_with_the_threshold_fixed():
    """Every width from 1 to 100 rows, twice, after one pass at the widest: with the
    threshold fixed the process keeps what the widest pass needed (measured: +1 MiB;
    glibc's dynamic threshold: +19 MiB on the same passes, and GiBs on a real model)."""
    dynamic, fixed = _growth_mib("dynamic"), _growth_mib("fixed")
    print(f"resident growth: dynamic threshold {dynamic:+.1f} MiB, fixed {fixed:+.1f} MiB")
    assert fixed <= 4.0
