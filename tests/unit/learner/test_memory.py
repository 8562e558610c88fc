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


# bf16 matmuls through torch's oneDNN path, forward and backward, at a new row count each time (as a rollout
# stream's micro-batches come): reports the MiB of RSS gained after the first few shapes.
KERNEL_CHILD = r"""
import json, os, sys
import torch
from asyncrl.learner.memory import KERNEL_CACHE_VARS, bound_kernel_caches

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

for var in KERNEL_CACHE_VARS:
    os.environ.pop(var, None)
caps = bound_kernel_caches(int(sys.argv[1])) if sys.argv[1] != "default" else {}
torch.set_num_threads(1)
linears = [torch.nn.Linear(576, n, bias=False) for n in (576, 192, 1536)]
start = None
for i, rows in enumerate(range(300, 300 + 7 * 70, 7)):
    x = torch.randn(rows, 576, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sum(lin(x).float().sum() for lin in linears)
    loss.backward()
    if i == 9:
        start = rss_mib()
print(json.dumps({"caps": caps, "grown": rss_mib() - start}))
"""


def _kernel_run(capacity: str) -> dict:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", KERNEL_CHILD, capacity], capture_output=True, text=True, env=env,
                         timeout=300, check=True)  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def _cpu_has_bf16_dot() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def test_bounded_kernel_caches_stop_rss_growing_with_every_new_bf16_shape():
    capped = _kernel_run("16")
    assert capped["caps"] == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "16", "LRU_CACHE_CAPACITY": "16"}
    assert capped["grown"] < 64, capped  # 60 new shapes after the caches filled
    if _cpu_has_bf16_dot():  # where bf16 matmuls run in oneDNN: the default caches keep every shape
        default = _kernel_run("default")
        assert default["grown"] > 4 * max(capped["grown"], 16), (default, capped)


def test_kernel_cache_bound_respects_the_users_setting(monkeypatch):
    from asyncrl.learner.memory import bound_kernel_caches

    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "512")
    monkeypatch.delenv("LRU_CACHE_CAPACITY", raising=False)
    assert bound_kernel_caches(64) == {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "512", "LRU_CACHE_CAPACITY": "64"}
    with pytest.raises(ValueError, match="capacity"):
        bound_kernel_caches(0)
