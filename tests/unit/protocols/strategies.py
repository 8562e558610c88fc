"""Hypothesis strategies that build every valid asyncrl message (shared by unit and integration tests)."""

from __future__ import annotations

import math

from hypothesis import strategies as st

import protocols as P

ids = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=24)
small_floats = st.floats(allow_nan=False, allow_infinity=False, width=64)
meta = st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3)
fmetrics = st.dictionaries(st.text(max_size=12), small_floats, max_size=4)


@st.composite
def arrays(draw, dtype: str | None = None, ndim: int | None = None, max_len: int = 32) -> P.Array:
    dtype = dtype or draw(st.sampled_from(sorted(P.DTYPE_SIZES)))
    ndim = draw(st.integers(0, 3)) if ndim is None else ndim
    shape = tuple(draw(st.lists(st.integers(0, max_len), min_size=ndim, max_size=ndim)))
    n = math.prod(shape) * P.DTYPE_SIZES[dtype]
    data = draw(st.binary(min_size=n, max_size=n))
    return P.Array(dtype=dtype, shape=shape, data=data)


sampling = st.builds(
    P.SamplingParams,
    temperature=st.floats(0, 4),
    top_p=st.floats(0.01, 1.0),
    top_k=st.integers(-1, 100),
    max_new_tokens=st.integers(1, 4096),
    stop_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=4),
    seed=st.integers(0, 2**63 - 1),
)


@st.composite
def finished_samples(draw) -> P.FinishedSample:
    n = draw(st.integers(0, 40))
    return P.FinishedSample(
        sample_id=draw(ids),
        group_id=draw(ids),
        prompt_ids=draw(arrays("int32", 1)),
        response_ids=P.Array(dtype="int32", shape=(n,), data=draw(st.binary(min_size=4 * n, max_size=4 * n))),
        behav_logp=P.Array(dtype="float32", shape=(n,), data=draw(st.binary(min_size=4 * n, max_size=4 * n))),
        versions=P.Array(dtype="int32", shape=(n,), data=draw(st.binary(min_size=4 * n, max_size=4 * n))),
        finish_reason=draw(st.sampled_from(P.FINISH_REASONS)),
        worker_id=draw(ids),
        engine=draw(st.sampled_from(["native", "sglang"])),
        quant_format=draw(st.sampled_from(["fp32", "int8", "nvfp4"])),
        timings=draw(fmetrics),
    )


@st.composite
def assignments(draw) -> P.RolloutAssignment:
    sample_ids = draw(st.lists(ids, min_size=1, max_size=8))
    return P.RolloutAssignment(
        group_id=draw(ids),
        sample_ids=sample_ids,
        prompt_ids=draw(arrays("int32", 1)),
        params=draw(sampling),
        n_samples=len(sample_ids),
    )


tensor_specs = st.builds(
    P.TensorSpec,
    name=ids,
    dtype=st.sampled_from(sorted(P.DTYPE_SIZES)),
    shape=st.lists(st.integers(0, 4096), max_size=3).map(tuple),
    nbytes=st.integers(0, 2**40),
    role=st.sampled_from(["full", "codes", "scale"]),
)


@st.composite
def weight_deltas(draw):
    """A well-formed ``WeightDelta``: one part per manifest entry, in order; ``same`` parts carry no bytes."""
    manifest = draw(st.lists(tensor_specs, max_size=4, unique_by=lambda e: e.name))
    parts = []
    for e in manifest:
        kind = draw(st.sampled_from(P.DELTA_KINDS))
        nbytes = 0 if kind == "same" else draw(st.integers(1, 2**20))
        parts.append(P.DeltaPart(name=e.name, kind=kind, count=draw(st.integers(0, 2**20)), nbytes=nbytes))
    base = draw(st.integers(0, 10**6))
    return P.WeightDelta(version=base + draw(st.integers(1, 10)), fmt=draw(st.sampled_from(["fp32", "int8"])),
                         base_version=base, base_checksum=draw(st.text(max_size=64)), manifest=manifest,
                         checksum=draw(st.text(max_size=64)), parts=parts, total_bytes=sum(p.nbytes for p in parts),
                         full_bytes=draw(st.integers(0, 2**40)), aqn_seed=draw(st.integers(-1, 2**31)),
                         aqn_sigma=draw(st.floats(0, 1)))


@st.composite
def weight_buckets(draw):
    """A well-formed ``WeightBucket``: of a whole version (no parts) or of a delta (one part per entry); the last
    bucket ends the stream."""
    entries = draw(st.lists(tensor_specs, max_size=4, unique_by=lambda e: e.name))
    delta = draw(st.booleans())
    parts = []
    if delta:
        for e in entries:
            kind = draw(st.sampled_from(P.DELTA_KINDS))
            nbytes = 0 if kind == "same" else draw(st.integers(1, 2**20))
            parts.append(P.DeltaPart(name=e.name, kind=kind, count=draw(st.integers(0, 2**20)), nbytes=nbytes))
    size = draw(st.integers(1, 2**30))
    index, nbytes, last = draw(st.integers(0, 1000)), draw(st.integers(0, size)), draw(st.booleans())
    return P.WeightBucket(version=draw(st.integers(1, 10**6)), fmt=draw(st.sampled_from(["int8", "nvfp4"])),
                          index=index, bucket_bytes=size, nbytes=nbytes, pieces=draw(st.integers(0, 64)),
                          digest=draw(st.text(max_size=48)), entries=entries, parts=parts,
                          base_version=draw(st.integers(0, 10**5)) if delta else -1,
                          base_checksum=draw(st.text(max_size=64)), last=last,
                          checksum=draw(st.text(max_size=64)) if last else "", buckets=index + 1 if last else 0,
                          total_bytes=index * size + nbytes if last else 0, full_bytes=draw(st.integers(0, 2**40)),
                          aqn_seed=draw(st.integers(-1, 2**31)), aqn_sigma=draw(st.floats(0, 1)))


@st.composite
def train_samples(draw) -> P.TrainSample:
    fs = draw(finished_samples())
    return P.TrainSample(
        sample_id=fs.sample_id, group_id=fs.group_id, prompt_ids=fs.prompt_ids, response_ids=fs.response_ids,
        behav_logp=fs.behav_logp, versions=fs.versions, advantage=draw(small_floats), reward=draw(small_floats),
        finish_reason=fs.finish_reason,
    )


addresses = st.builds("tcp://{}:{}".format, st.sampled_from(["127.0.0.1", "node-3"]), st.integers(1, 65535))
worker_setups = st.builds(
    P.WorkerSetup, samples_address=addresses, weights_announce=addresses, weights_fetch=addresses,
    model_config=st.builds(lambda v: f'{{"vocab_size": {v}, "model_type": "llama"}}', st.integers(1, 10**6)),
    worker_slots=st.integers(1, 4096), heartbeat_s=st.floats(1e-3, 60), quant_format=st.sampled_from(["fp32", "int8"]),
    eos_token_ids=st.lists(st.integers(0, 2**31 - 1), max_size=3), model_id=st.text(max_size=16),
    model_dir=st.text(max_size=16), max_seq_len=st.integers(0, 2**20), group_size=st.integers(0, 1024),
)
run_setups = st.builds(P.RunSetup, run_dir=ids, model_dir=ids,
                       publish_formats=st.lists(st.sampled_from(["fp32", "int8", "nvfp4"]), max_size=3))

MESSAGES = {
    P.Hello: st.builds(P.Hello, protocol_version=st.just(P.PROTOCOL_VERSION), role=st.sampled_from(P.ROLES),
                       peer_id=ids, capabilities=meta, version=st.integers(-1, 10**6)),
    P.Welcome: st.builds(P.Welcome, protocol_version=st.just(P.PROTOCOL_VERSION), server_id=ids,
                         latest_version=st.integers(-1, 10**6), config=meta, setup=st.none() | worker_setups,
                         run=st.none() | run_setups),
    P.Reject: st.builds(P.Reject, reason=st.text(max_size=64)),
    P.WorkRequest: st.builds(P.WorkRequest, worker_id=ids, credits=st.integers(0, 10**6),
                             version=st.integers(-1, 10**6)),
    P.RolloutAssignment: assignments(),
    P.NoWork: st.builds(P.NoWork, retry_after_s=st.floats(0, 10)),
    P.FinishedSample: finished_samples(),
    P.WeightAnnounce: st.builds(P.WeightAnnounce, version=st.integers(0, 10**6), fmt=st.sampled_from(["fp32", "int8"]),
                                manifest=st.lists(tensor_specs, max_size=4), checksum=st.text(max_size=64),
                                total_bytes=st.integers(0, 2**40), aqn_seed=st.integers(-1, 2**31),
                                aqn_sigma=st.floats(0, 1)),
    P.WeightFetch: st.builds(P.WeightFetch, version=st.integers(-1, 10**6), fmt=st.sampled_from(["", "int8"]),
                             base_version=st.integers(-1, 10**6), base_checksum=st.text(max_size=64),
                             bucket_bytes=st.integers(-1, 2**30), bucket=st.integers(0, 10**4)),
    P.WeightDelta: weight_deltas(),
    P.WeightBucket: weight_buckets(),
    P.WeightChunk: st.builds(P.WeightChunk, version=st.integers(0, 10**6), index=st.integers(0, 100),
                             count=st.integers(1, 100), name=ids, dtype=st.sampled_from(sorted(P.DTYPE_SIZES)),
                             shape=st.lists(st.integers(0, 64), max_size=3).map(tuple), nbytes=st.integers(0, 64),
                             offset=st.integers(0, 2**40)),
    P.TrainSample: train_samples(),
    P.BatchRequest: st.builds(P.BatchRequest, step=st.integers(0, 10**6)),
    P.TrainBatch: st.builds(P.TrainBatch, step=st.integers(0, 10**6), samples=st.lists(train_samples(), max_size=3),
                            metrics=fmetrics),
    P.VersionUpdate: st.builds(P.VersionUpdate, version=st.integers(0, 10**6), metrics=fmetrics,
                               checkpoint=st.booleans(), done=st.booleans()),
    P.Heartbeat: st.builds(P.Heartbeat, peer_id=ids, time=small_floats, stats=fmetrics, version=st.integers(-1, 10**6)),
    P.Goodbye: st.builds(P.Goodbye, peer_id=ids, unfinished=st.lists(ids, max_size=4), reason=st.text(max_size=16)),
    P.Shutdown: st.builds(P.Shutdown, reason=st.text(max_size=32)),
    P.Error: st.builds(P.Error, code=st.text(max_size=16), message=st.text(max_size=64)),
}

any_message = st.one_of(*MESSAGES.values())


def payload_for(msg) -> bytes | None:
    """The raw payload frame a message needs on the wire (WeightChunk only)."""
    return bytes(msg.nbytes) if isinstance(msg, P.WeightChunk) else None
