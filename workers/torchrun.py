"""``asyncrl torchrun``: torchrun (``torch.distributed.run``, the same arguments) for which a stop is a stop.

torchrun turns SIGTERM or SIGINT into a ``SignalException``: it passes the signal on to its ranks, waits
for them, and then ends with that exception's traceback and exit status 1, even when every learner rank
stopped as asked (a resumable checkpoint written, exit status 0): a requested stop looks like a crash.
This agent is torchrun itself, with one difference: the first SIGTERM or SIGINT is passed on to every
rank and the agent goes on waiting for them as for any end of training, so a learner that stopped as
asked ends it with status 0 (rank 0's log says where its checkpoint is, ``learner stopped as asked ...``),
and a rank that failed still fails it. A second signal is torchrun's own way out: the ranks get the
signal again and are killed after ``--shutdown-timeout`` seconds, and the agent exits 1.

Owns: the agent's SIGTERM/SIGINT handling. Never: signals a process that is not one of its own ranks.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Sequence

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TORCH_HANDLES = "SIGHUP,SIGQUIT"
"""The signals left to torchrun's own handler (its default list less ``STOP_SIGNALS``)."""


def main(argv: Sequence[str] | None = None) -> int:
    import psutil  # type: ignore[import-untyped]
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing import SignalException

    requested: list[int] = []

    def on_stop(signum: int, _frame) -> None:
        ranks = psutil.Process().children()  # the ranks this agent started (the rendezvous store is a thread)
        if requested or not ranks:  # asked twice, or before any rank runs: torchrun's own shutdown
            raise SignalException(f"asyncrl torchrun got {signal.Signals(signum).name}", signal.Signals(signum))
        requested.append(signum)
        for rank in ranks:
            try:
                rank.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    args = list(sys.argv[1:] if argv is None else argv)
    before = {s: signal.signal(s, on_stop) for s in STOP_SIGNALS}
    program, sys.argv[0] = sys.argv[0], "asyncrl torchrun"  # torchrun's usage and errors name this command
    try:
        torchrun.main([f"--signals-to-handle={TORCH_HANDLES}", *args])  # raises if a rank failed
    finally:
        sys.argv[0] = program
        for s, handler in before.items():
            signal.signal(s, handler)
    if args[:1] in (["-h"], ["--help"]):  # torchrun's main returns after its help; a help ends the command
        raise SystemExit(0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
