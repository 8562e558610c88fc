"""``asyncrl replay run=runs/<name> [overrides]``: retrain from a run's trajectory log, no controller,
no workers.

Owns: the replay's one child, the learner reading the source run's log (``--replay-log``), and the
replay's ``summary.json`` (``replay_of`` names the source run; staleness and sample counts come from
the log). Its run folder, configuration and checks are ``workers/prepare.py`` (``prepare_replay``).
With ``replay.allow_prefix=true`` on a run still training, the learner replays only the steps counted when
the replay started (``--replay-steps``).
Never: writes into the source run's folder.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence

from asyncrl.rundir import RunDir
from workers.launcher import Launcher, last_reward, learner_command
from workers.prepare import prepare_replay


def run_replay(overrides: Sequence[str]) -> int:
    """``asyncrl replay run=runs/<name> [overrides]``: retrain from the run's trajectory log, no workers.

    With no overrides the final weights are bit-identical to the original run's (CPU); with overrides
    (``algo=tbpo``, ``learner.lr=...``) it is a counterfactual on the same data, in its own run folder.
    """
    from asyncrl.metrics import format_summary, make_plots, write_summary

    cfg, src, src_log, run_dir, model_dir, prefix_steps = prepare_replay(overrides)
    print(f"asyncrl replay: {src_log} -> {run_dir}")
    launcher = Launcher(cfg, run_dir, model_dir)
    prefix = [] if prefix_steps is None else ["--replay-steps", str(prefix_steps)]
    t0 = time.monotonic()
    try:
        learner = launcher.spawn("learner", learner_command(cfg.learner.world_size, [
            "--run-dir", str(run_dir), "--model-dir", str(model_dir), "--replay-log", str(src_log), *prefix]))
        rc = learner.proc.wait()
    except KeyboardInterrupt:
        launcher.stop()
        return 130
    finally:
        launcher.stop()  # the learner's ranks too, if its torchrun agent died
        launcher.close()
    if rc != 0:
        print(f"replay {learner.fatal_line()}\n{learner.tail()}")
        return rc
    from asyncrl.log.inspect import summarize

    learner_final = json.loads(RunDir(run_dir).learner_final.read_text())
    log_summary = summarize(src_log)
    staleness = [int(k) for k in log_summary["staleness_histogram"]]
    summary = {
        "final_train_reward": last_reward(run_dir), "eval_accuracy": learner_final.get("eval/accuracy"),
        "learner_steps": learner_final["version"], "wall_seconds": time.monotonic() - t0,
        "max_consumed_staleness": max(staleness) if staleness else 0, "samples_logged": log_summary["samples"],
        "state_dict_sha256": learner_final["state_dict_sha256"], "run_dir": str(run_dir), "replay_of": str(src),
    }
    make_plots(run_dir)
    write_summary(run_dir, summary)
    print(format_summary(summary))
    if prefix_steps is not None:
        print(f"asyncrl replay: replayed a prefix of {prefix_steps} steps of {src}, a run still training")
    return 0
