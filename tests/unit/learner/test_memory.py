"""bound_malloc_retention: freed tensors go back to the kernel (real child processes, real RSS)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.learner.memory import bound_malloc_retention

ROOT = Path(__file__).resolve().parents[3]

# Activations of a forward, in miniature: a large tensor freed early (which raises glibc's dynamic
# mmap threshold), then 2 MiB tensors interleaved with small ones that stay alive (like the layer
# inputs kept for activation checkpointing); the 2 MiB ones are freed. Reports the MiB of RSS the
# freed tensors still hold.
CHILD = r"""
import json, sys
import torch
from asyncrl.learner.memory import bound_malloc_retention

def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS"):
            return int(line.split()[1]) / 1024

took = bound_malloc_retention() if sys.argv[1] == "bounded" else None
first = torch.ones(4 << 20)  # 16 MiB
del first
before = rss_mib()
big, keep = [], []
for _ in range(100):
    big.append(torch.ones(512 << 10))  # 2 MiB, touched
    keep.append(torch.ones(4096))      # 16 KiB, stays alive
peak = rss_mib()
del big
print(json.dumps({"took": took, "allocated": peak - before, "retained": rss_mib() - before}))
"""


def _run(mode: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True, env=env, timeout=300,
                         check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"),
                    reason="glibc malloc only")  # fmt: skip
def test_bounded_malloc_returns_freed_activations_and_the_default_keeps_them():
    bounded, default = _run("bounded"), _run("default")
    assert bounded["took"] is True
    assert bounded["allocated"] > 150 and default["allocated"] > 150  # 200 MiB were touched
    assert bounded["retained"] < 0.2 * bounded["allocated"]
    # glibc's default keeps them (the cause the setting removes): the heap holes sit between live tensors
    assert default["retained"] > 0.5 * default["allocated"]


def test_threshold_outside_glibc_range_is_refused():
    with pytest.raises(ValueError, match="mmap_threshold"):
        bound_malloc_retention(1 << 30)
    with pytest.raises(ValueError, match="mmap_threshold"):
        bound_malloc_retention(100)
