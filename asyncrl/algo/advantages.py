"""Advantages and sample selection (docs/algorithms.md §2.7, §3.1-§3.3).

Owns the tensor interface of the group estimators (their arithmetic, without torch, is
``asyncrl.algo.outcome``: GRPO with unbiased std and epsilon 1e-6, Dr. GRPO without std, RLOO,
the singleton and zero-variance rules), DAPO overlong shaping, the truncation policy, and the
tensor interface of the DAPO dynamic-sampling filter (``is_informative_group`` per group).

Never: sees log-probs or versions; decides *when* a group is complete (the controller releases a
group only when all its members have finished).

Invariants: statistics are computed in float64; a zero-variance group gets exactly A = 0; a
singleton group gets A = 0 and is counted in ``adv/singleton_groups`` ([R]: verl would give A = R,
deliberately not copied); rewards must be finite (a NaN reward is a verifier bug, not data).
"""

from __future__ import annotations

import torch

from asyncrl.algo.config import ADV_EPS, ADVANTAGES, require_choice
from asyncrl.algo.outcome import is_informative_group, outcome_advantages
from asyncrl.algo.stats import MetricDict, Stat

__all__ = [
    "ADVANTAGES",
    "TRUNCATION_POLICIES",
    "group_advantages",
    "token_advantages",
    "overlong_penalty",
    "apply_truncation_policy",
    "is_informative_group",
    "filter_groups",
]


TRUNCATION_POLICIES = ("keep", "mask", "overlong_shaping")


def _groups(n: int, group_ids: torch.Tensor | None, device: torch.device) -> tuple[torch.Tensor, int]:
    """Inverse index [N] -> group 0..K-1 (in order of first id value) and K."""
    if group_ids is None:
        return torch.zeros(n, dtype=torch.int64, device=device), (1 if n else 0)
    if group_ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},) like rewards, got {tuple(group_ids.shape)}")
    uniq, inv = torch.unique(group_ids, return_inverse=True)
    return inv, int(uniq.numel())


def group_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    *,
    estimator: str = "grpo",
    eps: float = ADV_EPS,
) -> tuple[torch.Tensor, MetricDict]:
    """Outcome advantages A_i of complete groups (§3.1) for tensors: ``outcome_advantages`` (the
    torch-free function the controller uses). rewards: [N]; group_ids: [N] any ints (None = one
    group). Returns (A [N] in the rewards' float dtype and device, metrics).
    """
    require_choice("estimator", estimator, ADVANTAGES)
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N] (one scalar per response), got shape {tuple(rewards.shape)}")
    ids = None if group_ids is None else group_ids.detach().cpu().numpy()
    adv, c = outcome_advantages(rewards.detach().to("cpu", torch.float64).numpy(), ids, estimator=estimator, eps=eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    metrics = MetricDict({"adv/singleton_groups": Stat("sum", float(c.singleton)),
                          "adv/groups": Stat("sum", float(c.groups)),
                          "adv/zero_std_group_frac": Stat("mean", float(c.zero_var), float(c.multi))})
    return torch.from_numpy(adv).to(device=rewards.device, dtype=out_dtype), metrics


def token_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Broadcast outcome advantages [B] onto the response tokens: A_{i,t} = A_i m_{i,t}. -> [B, T]."""
    if adv.shape != mask.shape[:1]:
        raise ValueError(
            f"adv must be [B] with B = mask.shape[0], got {tuple(adv.shape)} vs mask {tuple(mask.shape)}"
        )
    return torch.where(mask.bool(), adv.unsqueeze(-1), torch.zeros((), dtype=adv.dtype, device=adv.device))


def overlong_penalty(
    lengths: torch.Tensor, *, max_len: int = 20480, cache_len: int = 4096, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO soft overlong penalty R^len(|y|) of §3.3, [N] lengths -> [N] float32 (added to the reward).

    0 up to max_len - cache_len, then linear down to -penalty_factor at max_len, -penalty_factor beyond.
    """
    if not 0 < cache_len <= max_len:
        raise ValueError(
            f"need 0 < cache_len <= max_len, got cache_len={cache_len}, max_len={max_len} "
            "(DAPO: 4096 and 20480)"
        )
    if penalty_factor < 0:
        raise ValueError(f"penalty_factor={penalty_factor} must be >= 0 (DAPO uses 1.0)")
    y = lengths.detach().to(torch.float64)
    start = max_len - cache_len
    ramp = penalty_factor * (start - y) / cache_len
    out = torch.where(y <= start, 0.0, torch.where(y <= max_len, ramp, -penalty_factor))
    return out.to(torch.float32)


def apply_truncation_policy(
    rewards: torch.Tensor,
    lengths: torch.Tensor,
    truncated: torch.Tensor,
    *,
    policy: str,
    max_len: int = 20480,
    cache_len: int = 4096,
    penalty_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """§2.7 ``truncated_policy``: returns (rewards [N], keep [N] bool).

    keep: nothing changes; mask: truncated responses get keep=False (zero their loss mask);
    overlong_shaping: the §3.3 penalty is added to every reward (all kept).
    """
    require_choice("truncated_policy", policy, TRUNCATION_POLICIES)
    keep = torch.ones_like(truncated, dtype=torch.bool)
    if policy == "mask":
        return rewards, ~truncated.bool()
    if policy == "overlong_shaping":
        pen = overlong_penalty(lengths, max_len=max_len, cache_len=cache_len, penalty_factor=penalty_factor)
        return rewards + pen.to(rewards.dtype), keep
    return rewards, keep


def filter_groups(
    values: torch.Tensor, group_ids: torch.Tensor | None = None
) -> tuple[torch.Tensor, MetricDict]:
    """``is_informative_group`` for tensors: values [N] (filter metric per response), group_ids [N].

    Returns (keep [N] bool per response, metrics with ``data/filtered_group_frac``).
    """
    v = values.detach().to(torch.float64).reshape(-1)
    inv, k = _groups(v.shape[0], group_ids, v.device)
    members: list[list[float]] = [[] for _ in range(k)]
    for g, x in zip(inv.tolist(), v.tolist(), strict=True):
        members[g].append(x)
    keep_group = torch.tensor([is_informative_group(m) for m in members], dtype=torch.bool, device=v.device)
    dropped = int((~keep_group).sum())
    metrics = MetricDict(
        {
            "data/filtered_group_frac": Stat("mean", float(dropped), float(k)),
            "data/filtered_groups": Stat("sum", float(dropped)),
        }
    )
    return keep_group[inv], metrics
