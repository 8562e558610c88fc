"""asyncrl.quant: the quantised actor (INT8 W8A8, FP8, NVFP4, MXFP4), quantise-on-send publication,
UAQ folding and AQN noise.

Owns: pure functions over tensors and state dicts (formats, rounding, publication, UAQ, AQN,
diagnostics) plus the quantised linear modules a rollout engine runs. docs/quantization.md is the
reader's guide; the rounding rules live in the module docstrings of int8.py, fp8.py and fp4.py.

Must never: import other asyncrl packages (this is a leaf), do I/O, or touch the learner's tensors
in place except through `fold_uaq` / `unfold_uaq` on a model, which are in place by contract.
"""

from protocols.values import AQN_RESAMPLE, FORMATS, QUANTIZED_FORMATS

from .aqn import (
    DEFAULT_AQN_SITES,
    AqnRecord,
    ForwardAqn,
    add_aqn_noise,
    aqn_sigma,
    aqn_sigma_paper,
    aqn_stage,
    aqn_trend,
    publication_seed,
)
from .bucketload import LoadedVersion, load_buckets
from .buffers import BufferPool
from .delta import DeltaStream, PublishedDelta, apply_delta, delta_from_frames, make_delta
from .diagnostics import code_change_frac, kl_vs_full_precision, publication_metrics, quantization_error
from .embedding import QuantEmbedding
from .errors import (
    BlockShapeError,
    ChecksumMismatchError,
    FormatMismatchError,
    ManifestMismatchError,
    NonFiniteWeightError,
    QuantError,
    UnknownFormatError,
)
from .formats import dequantize_weight, quantize_weight, weight_suffixes
from .fp4 import (
    dequantize_mxfp4,
    dequantize_nvfp4,
    e2m1_encode,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_fp4,
)
from .fp8 import dequantize_fp8, fp8_linear, quantize_fp8_rows
from .fused import fuse_siblings
from .int8 import dequantize_int8, int8_linear, quantize_act_int8, quantize_int8_rows
from .linear import LINEAR_CLASSES, QuantLinear
from .model import (
    DEFAULT_KEEP_FULL_PRECISION,
    TARGET_LINEARS,
    model_format,
    quantize_model,
    quantizes_embedding,
    quantizes_head,
)
from .publish import PublishedWeights, load_published, publish
from .uaq import UAQ_SITES, fold_uaq, unfold_uaq
from .wire import RawTensor

__all__ = [
    "DEFAULT_AQN_SITES",
    "DEFAULT_KEEP_FULL_PRECISION",
    "FORMATS",
    "LINEAR_CLASSES",
    "QUANTIZED_FORMATS",
    "TARGET_LINEARS",
    "UAQ_SITES",
    "AqnRecord",
    "BlockShapeError",
    "BufferPool",
    "DeltaStream",
    "LoadedVersion",
    "ChecksumMismatchError",
    "FormatMismatchError",
    "ManifestMismatchError",
    "NonFiniteWeightError",
    "PublishedDelta",
    "PublishedWeights",
    "QuantError",
    "QuantEmbedding",
    "QuantLinear",
    "RawTensor",
    "UnknownFormatError",
    "add_aqn_noise",
    "apply_delta",
    "load_buckets",
    "delta_from_frames",
    "make_delta",
    "AQN_RESAMPLE",
    "ForwardAqn",
    "aqn_sigma",
    "aqn_sigma_paper",
    "aqn_stage",
    "aqn_trend",
    "code_change_frac",
    "dequantize_fp8",
    "dequantize_int8",
    "dequantize_mxfp4",
    "dequantize_nvfp4",
    "dequantize_weight",
    "e2m1_encode",
    "fold_uaq",
    "fuse_siblings",
    "fp8_linear",
    "int8_linear",
    "kl_vs_full_precision",
    "load_published",
    "model_format",
    "publication_metrics",
    "publication_seed",
    "publish",
    "quantization_error",
    "quantize_act_int8",
    "quantize_fp8_rows",
    "quantize_int8_rows",
    "quantize_model",
    "quantizes_embedding",
    "quantizes_head",
    "quantize_mxfp4",
    "quantize_nvfp4",
    "quantize_weight",
    "unfold_uaq",
    "unpack_fp4",
    "weight_suffixes",
]
