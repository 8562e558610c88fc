"""Run AReaL's own loss on prepared cases, in a child process (``tests/interop/test_areal_parity.py``).

Usage: python areal_oracle.py SITE_DIR CASES.pt RESULTS.pt

The private install dir is *appended* to sys.path, so the project's own packages (and its torch)
always win, and ``areal.utils.functional`` is imported the ordinary way, through ``areal/__init__``,
exactly as AReaL users import it. A child process keeps AReaL's import closure (ray, aiohttp,
numba, ...) out of the pytest process.
"""

from __future__ import annotations

import json
import sys

import torch


def main() -> None:
    site, cases_path, out_path = sys.argv[1:4]
    sys.path.append(site)
    torch.set_num_threads(1)
    import areal
    import areal.utils.functional as functional
    from areal.api.cli_args import RejectionSamplingConfig

    cases = torch.load(cases_path)
    results = {}
    for name, c in cases.items():
        logp = c["logp"].clone().requires_grad_(True)
        rs = RejectionSamplingConfig(**c["rejection_sampling"]) if c["rejection_sampling"] else None
        loss, stat = functional.ppo_actor_loss_fn(
            logprobs=logp,
            proximal_logprobs=c["prox"],
            old_logprobs=c["behav"],
            advantages=c["adv"],
            eps_clip=c["eps_clip"],
            loss_mask=c["mask"],
            eps_clip_higher=c["eps_clip_higher"],
            c_clip=c["c_clip"],
            rejection_sampling=rs,
            importance_sampling_level=c["importance_sampling_level"],
        )
        loss.backward()
        results[name] = {
            "loss": loss.detach(),
            "grad": logp.grad.detach(),
            "clipped": stat["clip_mask"].sum().double(),
            "dual_clipped": stat["dual_clip_mask"].sum().double(),
        }
    torch.save(results, out_path)
    print(json.dumps({"areal_version": areal.__version__, "functional_file": functional.__file__}))


if __name__ == "__main__":
    main()
