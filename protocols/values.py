"""Value lists both ends of a socket share: weight formats, the AQN draw policy, finish reasons.

Owns: ``FORMATS`` (every published/actor weight format: ``WeightChunk.fmt``, a worker's quant format,
``quant.fmt`` of a run), ``QUANTIZED_FORMATS`` (those with codes and scales), ``AQN_RESAMPLE``
(``quant.aqn_resample``), ``FINISH_REASONS`` (how a sample ended) and ``QUARANTINED`` (how a ``Shutdown``
that quarantines a worker starts). The one definition of each:
``protocols.messages``, ``asyncrl.quant``, the engines and the run schema import them from here.
Never: imports anything beyond the standard library, or says how a format is computed (asyncrl/quant).
"""

from __future__ import annotations

FORMATS: tuple[str, ...] = ("fp32", "bf16", "int8", "int8_wo", "fp8", "nvfp4", "mxfp4")
QUANTIZED_FORMATS: tuple[str, ...] = ("int8", "int8_wo", "fp8", "nvfp4", "mxfp4")
AQN_RESAMPLE: tuple[str, ...] = ("publication", "forward")
"""When AQN noise is drawn: once per published version, or at every rollout forward (QeRL)."""
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort")
"""``stop`` (a stop token was sampled), ``length`` (max_new_tokens reached), ``abort`` (cancelled)."""
QUARANTINED = "quarantined: "
"""How ``Shutdown.reason`` starts when the controller gives a worker no more work because its samples kept
failing validation (``rollout.quarantine_after``); the rest says why. A worker logs it as an error and exits 1
(a worker that does not know the prefix still stops, as for any ``Shutdown``)."""


def require_choice(name: str, value: object, options: tuple[str, ...], error: type[Exception] = ValueError) -> None:
    """Refuse ``value`` unless it is one of ``options``, naming the setting and every valid value.

    The one wording of that refusal (``name=value is not valid; choose one of: a, b``) for the run
    schema, the algorithm configs, the engines, the quantisers and the tasks.
    """
    if value not in options:
        raise error(f"{name}={value!r} is not valid; choose one of: {', '.join(options)}")
