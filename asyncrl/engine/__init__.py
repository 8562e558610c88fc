"""Rollout engines behind one small interface (docs/architecture.md §3); see docs/engine.md.

``asyncrl.engine`` re-exports the contract types; engines are imported from their modules
(``asyncrl.engine.native.engine.NativeEngine``) so importing the contract never loads torch models.
"""

from asyncrl.engine.base import FINISH_REASONS, GenRequest, GenResult, RolloutEngine, SamplingParams

__all__ = ["FINISH_REASONS", "GenRequest", "GenResult", "RolloutEngine", "SamplingParams"]
