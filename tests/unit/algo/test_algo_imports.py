"""``import asyncrl.algo`` stays a leaf: no zmq, msgspec, transport, distributed code or siblings."""

from __future__ import annotations

import json
import subprocess

PROBE = r"""
import json, sys
import torch
before = set(sys.modules)
import asyncrl.algo
new = sorted(set(sys.modules) - before)
print(json.dumps({"new": new, "all": sorted(sys.modules)}))
"""


def test_importing_algo_pulls_in_no_transport_or_distributed_code(procs):
    proc = procs.python("-c", PROBE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    mods = json.loads(out)
    every, new = mods["all"], mods["new"]
    forbidden = ("zmq", "msgspec", "protocols", "hydra", "omegaconf")
    assert not [m for m in every if m.split(".")[0] in forbidden], (
        "asyncrl.algo must not load transport/config libs"
    )
    # torch itself loads some torch.distributed modules; asyncrl.algo must not add any
    assert not [m for m in new if m.startswith("torch.distributed")]
    # asyncrl._lazy: the standard-library helper behind the package's lazy exports; asyncrl.config.algo: the
    # algorithm's options, standard library only, in a package that exports nothing (test_layout.py)
    allowed = ("asyncrl._lazy", "asyncrl.config", "asyncrl.config.algo")
    siblings = [m for m in new if m.startswith("asyncrl.") and not m.startswith("asyncrl.algo") and m not in allowed]
    assert not siblings, f"asyncrl.algo imported sibling packages {siblings}"
