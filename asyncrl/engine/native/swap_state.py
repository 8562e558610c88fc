"""What a weight load at a native-engine step boundary changes besides the weights themselves.

Owns: ``SwapState`` -- the per-forward AQN noise of the version just loaded (``asyncrl.quant.ForwardAqn``,
built on first use, for a publication with ``aqn_resample="forward"``) and the weights' addresses that
captured decode graphs read (a load that moved a tensor drops the graphs, which are then captured again).

Must never: load weights (``asyncrl.engine.native.weights.apply_weights`` does, before ``loaded`` is called), take
an engine lock, or run anywhere but on the engine thread at a step boundary (``NativeEngine.step``).

Invariant: after ``loaded``, ``pointers`` are the addresses of the model's parameters and buffers, and
``forward_aqn()`` is the noise of the loaded version (None when it has none).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from asyncrl.engine.native.static_step import StaticStep
from asyncrl.engine.native.step_graphs import tensor_pointers

log = logging.getLogger(__name__)


class SwapState:
    """The state one ``NativeEngine`` keeps across weight loads (see module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.pointers = tensor_pointers(model)
        self.aqn: Any = None  # asyncrl.quant.ForwardAqn once a version asks for per-forward AQN noise

    def loaded(self, model: torch.nn.Module, weights: Any, static: StaticStep | None) -> None:
        """After ``weights`` were loaded into ``model``: set their forward AQN, check the graphs' addresses."""
        self.set_forward_aqn(model, weights)
        self.check_pointers(model, static)

    def forward_aqn(self) -> Any:
        """The ``ForwardAqn`` the next forward must apply, or None (no noise in the loaded version)."""
        return self.aqn if self.aqn is not None and self.aqn.sigma > 0 else None

    def set_forward_aqn(self, model: torch.nn.Module, weights: Any) -> None:
        """Per-forward AQN (``aqn_resample == "forward"`` in the publication): hooks built on first use."""
        sigma = float(getattr(weights, "aqn_sigma", 0.0) or 0.0)
        if getattr(weights, "aqn_resample", "publication") == "forward" and sigma > 0:
            if self.aqn is None:
                from asyncrl.quant import ForwardAqn

                self.aqn = ForwardAqn(model)
            self.aqn.set_publication(weights.aqn_seed, sigma)
        elif self.aqn is not None:
            self.aqn.set_publication(None, 0.0)

    def check_pointers(self, model: torch.nn.Module, static: StaticStep | None) -> None:
        """After a load: captured graphs read weights by address, so a load that moved one drops them."""
        pointers = tensor_pointers(model)
        if pointers != self.pointers and static is not None and static.graphs.runners:
            log.warning("a weight load reallocated parameters; the captured decode graphs are rebuilt")
            static.graphs.invalidate()
        self.pointers = pointers
