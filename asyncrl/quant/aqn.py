"""AQN (docs/algorithms.md §9): the released stage schedule and per-publication noise on RMSNorm gains.

Owns: `aqn_sigma` (schedule of NVlabs/QeRL `trl_trainer/noise_scheduler.py`, normative in §9),
`aqn_trend`, the paper's indexing for comparison, and `add_aqn_noise`, which draws fresh Gaussian noise
on copies of the chosen RMSNorm gains of one publication.

Noise rule: for every gain tensor whose name is `<prefix>.<site>.weight` with `<site>` in `sites`, a
generator seeded with `derive_seed(seed, name)` (sha256 of "seed:name", first 8 bytes) draws
z ~ N(0, sigma_site^2) in fp32 with the gain's shape; the published gain is `fp32(g) + z` cast back to
the gain's dtype. sigma_site = sigma * uaq_s when the gain was scaled by UAQ (`uaq_sites`) and
`scale_with_uaq` (§9, same relative perturbation), else sigma. The noise of a tensor depends only on
(seed, name, sigma_site), not on which other sites are chosen.

Two resampling modes (`quant.aqn_resample`, §9):
* `publication` (default): `add_aqn_noise` draws once per publication; every rollout of the version
  shares the noisy gains. Must never modify its input tensors (the learner's gains stay clean).
* `forward` (QeRL): the publication carries clean gains plus (seed, sigma), and the rollout engine
  installs `ForwardAqn`, which perturbs the gains afresh at every engine forward: for the forward that
  samples token `t` of request `sample_id`, every site gets z ~ N(0, sigma^2) drawn from a generator
  seeded with `derive_seed(seed, f"{sample_id}\x1f{t}")` ([n_sites, hidden], sites in name order).
  The draw depends only on (version seed, sample id, token index), not on the batch, so a token's
  noisy forward is reproducible, and its behaviour log-prob is the one of that noisy forward. The
  K/V of earlier positions keep the noise they were computed with (as in a vLLM rollout).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import QuantError

DEFAULT_AQN_SITES: tuple[str, ...] = ("input_layernorm", "post_attention_layernorm")
UAQ_SITE_NORMS: dict[str, str] = {"attn_qkv": "input_layernorm", "mlp_gate_up": "post_attention_layernorm"}


def _check_schedule(total_steps: int, sigma_start: float, sigma_end: float, num_stages: int) -> None:
    if num_stages < 2:
        raise QuantError(f"num_stages must be >= 2 (stage 0 is noise-free), got {num_stages}")
    if total_steps < 1:
        raise QuantError(f"total_steps must be >= 1, got {total_steps}")
    if not (sigma_start > 0 and sigma_end > 0 and math.isfinite(sigma_start) and math.isfinite(sigma_end)):
        raise QuantError(f"sigma_start and sigma_end must be finite and > 0, got {sigma_start}, {sigma_end}")


def aqn_trend(sigma_start: float, sigma_end: float, num_stages: int) -> list[float]:
    """sigma_trend_j = sigma_s * (sigma_e / sigma_s) ** (j / (K - 2)), j = 0..K-2 (K=2: [sigma_s])."""
    _check_schedule(1, sigma_start, sigma_end, num_stages)
    span = num_stages - 2
    if span == 0:
        return [float(sigma_start)]
    return [sigma_start * (sigma_end / sigma_start) ** (j / span) for j in range(span + 1)]


def aqn_stage(step: int, total_steps: int, num_stages: int) -> int:
    """kappa(n) = floor(min(n, T) / (T / K)), computed exactly as floor(min(n, T) * K / T)."""
    if step < 0:
        raise QuantError(f"step must be >= 0, got {step}")
    return (min(step, total_steps) * num_stages) // total_steps


def aqn_sigma(step: int, total_steps: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """Released schedule (§9): 0 in stage 0, then trend[min(kappa - 1, K - 2)]."""
    _check_schedule(total_steps, sigma_start, sigma_end, num_stages)
    k = aqn_stage(step, total_steps, num_stages)
    if k == 0:
        return 0.0
    return aqn_trend(sigma_start, sigma_end, num_stages)[min(k - 1, num_stages - 2)]


def aqn_sigma_paper(stage: int, sigma_start: float, sigma_end: float, num_stages: int) -> float:
    """The paper's indexing, sigma(k) = sigma_s (sigma_e / sigma_s) ** ((k-1)/(K-1)), k = 1..K; for
    comparison only (it differs from the released schedule by one stage, §9)."""
    if not 1 <= stage <= num_stages:
        raise QuantError(f"paper stage must be in 1..{num_stages}, got {stage}")
    return sigma_start * (sigma_end / sigma_start) ** ((stage - 1) / (num_stages - 1))


def derive_seed(seed: int, name: str) -> int:
    """Per-tensor seed: first 8 bytes of sha256(f"{seed}:{name}"), as a non-negative int63."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") >> 1


def publication_seed(base_seed: int, version: int) -> int:
    """A fresh, reproducible AQN seed per published version (derive once, record with the version)."""
    return derive_seed(base_seed, f"version={version}")


@dataclass(frozen=True)
class AqnRecord:
    """What to record with a published version to reproduce its noise."""

    seed: int
    sigma: float
    sites: tuple[str, ...]


def add_aqn_noise(
    tensors: Mapping[str, Tensor],
    *,
    sigma: float,
    seed: int,
    sites: Sequence[str] = DEFAULT_AQN_SITES,
    uaq_s: float = 1.0,
    uaq_sites: Sequence[str] = (),
    scale_with_uaq: bool = True,
) -> tuple[dict[str, Tensor], AqnRecord]:
    """Return a new dict where the gains of `sites` are replaced by noisy copies (rule in the module
    docstring); other entries are the same objects. Inputs are never modified.

    tensors: state-dict names -> tensors; gains are `...<site>.weight` [hidden].
    """
    if not (math.isfinite(sigma) and sigma >= 0):
        raise QuantError(f"AQN sigma must be finite and >= 0, got {sigma}")
    unknown = [s for s in uaq_sites if s not in UAQ_SITE_NORMS]
    if unknown:
        raise QuantError(f"unknown UAQ site(s) {unknown}; choose from {sorted(UAQ_SITE_NORMS)}")
    folded_norms = {UAQ_SITE_NORMS[s] for s in uaq_sites} if scale_with_uaq else set()
    out = dict(tensors)
    hits = 0
    for name in sorted(tensors):
        parts = name.split(".")
        if len(parts) < 2 or parts[-1] != "weight" or parts[-2] not in sites:
            continue
        hits += 1
        if sigma == 0:
            continue
        g = tensors[name]
        site_sigma = sigma * uaq_s if parts[-2] in folded_norms else sigma
        gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, name))
        z = torch.randn(tuple(g.shape), generator=gen, dtype=torch.float32) * site_sigma
        out[name] = (g.detach().float().cpu() + z).to(device=g.device, dtype=g.dtype)
    if hits == 0:
        raise QuantError(f"no RMSNorm gain named '*.<site>.weight' for AQN sites {tuple(sites)}")
    return out, AqnRecord(seed=int(seed), sigma=float(sigma), sites=tuple(sites))


def forward_noise(seed: int, sample_id: str, t: int, sigma: float, n_sites: int, hidden: int) -> Tensor:
    """z [n_sites, hidden] fp32 of the forward that samples token `t` of `sample_id` (module docstring)."""
    gen = torch.Generator(device="cpu").manual_seed(derive_seed(seed, f"{sample_id}\x1f{t}"))
    return torch.randn((n_sites, hidden), generator=gen, dtype=torch.float32) * sigma


class ForwardAqn:
    """Per-forward AQN on a model's RMSNorm modules (forward hooks; the gains themselves are untouched).

    Sites are the modules whose name ends with `.<site>` for `site` in `sites`, in name order. With noise
    set for a batch (`set_rows`), each hooked module returns `(g + z_row) * normed(x)`, computed as
    `out + z_row * normed(x)` with `normed(x) = x * rsqrt(mean(x^2) + eps)` in fp32 (the HF RMSNorm's
    own normalisation; `eps` is the module's `variance_epsilon`). Without rows set, or with sigma 0,
    the hooks return the module's output unchanged.
    """

    def __init__(self, model: torch.nn.Module, sites: Sequence[str] = DEFAULT_AQN_SITES) -> None:
        mods = [(n, m) for n, m in model.named_modules() if n.rsplit(".", 1)[-1] in sites]
        if not mods:
            raise QuantError(f"no RMSNorm module named '*.<site>' for AQN sites {tuple(sites)}")
        for name, m in mods:
            if not hasattr(m, "variance_epsilon") or getattr(m, "weight", None) is None:
                raise QuantError(f"AQN site {name} is not an RMSNorm with a gain and variance_epsilon")
        self.names = [n for n, _ in sorted(mods, key=lambda x: x[0])]
        self.hidden = int(mods[0][1].weight.shape[-1])
        self.seed = 0
        self.sigma = 0.0
        self._z: Tensor | None = None  # [rows, n_sites, hidden] for the forward in progress
        self._handles = []
        by_name = dict(mods)
        for i, name in enumerate(self.names):
            self._handles.append(by_name[name].register_forward_hook(self._hook(i)))

    def set_publication(self, seed: int | None, sigma: float) -> None:
        """Noise parameters of the version now loaded (sigma 0 or seed None: no noise)."""
        if not (math.isfinite(sigma) and sigma >= 0):
            raise QuantError(f"AQN sigma must be finite and >= 0, got {sigma}")
        self.sigma = float(sigma) if seed is not None else 0.0
        self.seed = int(seed) if seed is not None else 0

    def set_rows(self, keys: Sequence[tuple[str, int]] | None) -> None:
        """(sample_id, token index) of each row of the next forward; None clears the noise."""
        if not keys or self.sigma == 0.0:
            self._z = None
            return
        self._z = torch.stack(
            [forward_noise(self.seed, sid, t, self.sigma, len(self.names), self.hidden) for sid, t in keys]
        )

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def _hook(self, index: int):
        def hook(module: torch.nn.Module, args: tuple, out: Tensor) -> Tensor:
            z = self._z
            if z is None:
                return out
            x = args[0].float()
            normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
            noise = z[:, index].to(x.device).view(z.shape[0], *([1] * (x.dim() - 2)), z.shape[-1])
            return out + (normed.to(out.dtype) * noise.to(out.dtype))

        return hook
