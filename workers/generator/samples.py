"""A generation worker's samples: what it was assigned, what it streamed back, what it hands back.

Owns: the worker's outstanding samples (sample id -> group id, assigned and not yet sent), the queue of
finished ones between the engine thread (which puts) and the comms thread (which sends), turning an
assignment into engine requests, streaming each finished sample to the controller's sample socket at
once, and the list of unfinished samples a leaving worker hands back in its ``Goodbye``.
Never: talks to the engine or opens a socket itself (``workers/generator/process.py`` submits the requests and
owns the sockets; the channel to send on is passed in).

Invariants: a sample leaves this worker once, as a ``FinishedSample``, or is handed back; an aborted
partial sample is never sent as a result. A sample the controller stops taking (the socket's
high-water mark for ``SAMPLE_SEND_TIMEOUT_S``) is kept for the next try, not dropped.
"""

from __future__ import annotations

import logging
import queue

import numpy as np

import protocols as P
from asyncrl.engine.base import GenRequest, GenResult, SamplingParams
from asyncrl.transport import ChannelTimeout, ZmqChannel

log = logging.getLogger("asyncrl.worker")

SAMPLE_SEND_TIMEOUT_S = 30.0
"""How long a finished sample may wait at the samples socket's high-water mark (the controller not
reading) before it is kept for the next try."""


class SampleStream:
    """The samples of one worker (``worker_id``, running an ``engine`` of that kind).

    The engine thread calls ``finished`` only; every other method is the comms thread's."""

    def __init__(self, worker_id: str, engine: str) -> None:
        self.worker_id, self.engine = worker_id, engine
        self.results: queue.Queue[GenResult] = queue.Queue()
        self.outstanding: dict[str, str] = {}  # sample id -> group id, assigned and not yet sent
        self.sent = 0
        self.tokens = 0

    def finished(self, res: GenResult) -> None:
        """A result of the engine (finished, or aborted), to be sent by the comms thread."""
        self.results.put(res)

    def accept(self, a: P.RolloutAssignment) -> list[GenRequest]:
        """Record an assignment; the engine requests for those of its samples not already running here."""
        prompt = a.prompt_ids.to_numpy().tolist()
        p = a.params
        params = SamplingParams(max_new_tokens=p.max_new_tokens, temperature=p.temperature, top_p=p.top_p,
                                top_k=p.top_k, stop_token_ids=tuple(p.stop_token_ids) or None, seed=p.seed)
        # A group the controller took back (overdue, or this worker was declared dead) may come back to this
        # worker while its samples still run here: those keep running, and their results count for it.
        if len(new := [sid for sid in a.sample_ids if sid not in self.outstanding]) < len(a.sample_ids):
            log.info("group %s came back to worker %s while it still runs here", a.group_id, self.worker_id)
        for sid in a.sample_ids:
            self.outstanding[sid] = a.group_id
        return [GenRequest(sample_id=sid, prompt_ids=prompt, params=params) for sid in new]

    def flush(self, push: ZmqChannel, quant_format: str) -> None:
        """Send every finished sample waiting (an actor of ``quant_format`` made it); stop at the first one
        the controller does not take in time, keeping it for the next call."""
        while True:
            try:
                res = self.results.get_nowait()
            except queue.Empty:
                return
            group_id = self.outstanding.get(res.sample_id)
            if group_id is None or res.finish_reason == "abort":
                continue  # aborted partial samples are handed back in Goodbye, never sent as results
            msg = P.FinishedSample(
                sample_id=res.sample_id, group_id=group_id,
                prompt_ids=P.Array.from_numpy(np.asarray(res.prompt_ids, np.int32)),
                response_ids=P.Array.from_numpy(np.asarray(res.response_ids, np.int32)),
                behav_logp=P.Array.from_numpy(res.behav_logp), versions=P.Array.from_numpy(res.versions),
                finish_reason=res.finish_reason, worker_id=self.worker_id, engine=self.engine,
                quant_format=quant_format, timings=res.timings,
            )
            try:
                push.send(msg, timeout_s=SAMPLE_SEND_TIMEOUT_S)
            except ChannelTimeout:
                log.error("controller stopped taking samples; keeping %s for the next try", res.sample_id)
                self.results.put(res)
                return
            del self.outstanding[res.sample_id]
            self.sent += 1
            self.tokens += len(res.response_ids)

    def unfinished(self) -> list[str]:
        """The samples assigned and not sent: what a leaving worker aborts and hands back."""
        return list(self.outstanding)
