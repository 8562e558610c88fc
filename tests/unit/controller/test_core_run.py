"""What ControllerCore does for the process around it (the loop only moves bytes): the run setup a learner asks
for, the metrics row and health watch of each learner version (a ``learner.stop_on`` alarm ends training), the
end-of-run files; and the typed scores of a group (zero variance decided once)."""

from __future__ import annotations

import json

import protocols as P
from asyncrl.controller.report import RunReport
from asyncrl.controller.scores import Scores
from asyncrl.controller.state import read_state
from asyncrl.metrics import MetricsWriter, read_metrics
from asyncrl.metrics.health_log import HealthWatch, read_alarms
from asyncrl.rundir import RunDir
from protocols.setup import SETUP_REQUEST
from tests.unit.controller.test_core import (
    answer,
    make_core,
    model_dir,  # noqa: F401 - the module fixture
    register,
)

SETUP = P.RunSetup(run_dir="/runs/r", model_dir="/models/m", publish_formats=["int8"])


def report_for(tmp_path, cfg, transport=lambda: {"transport/control/recv": 3.0}):
    return RunReport(MetricsWriter(tmp_path, tensorboard=False), HealthWatch(tmp_path, cfg.health, cfg.learner.stop_on),
                     transport=transport)


def test_a_learner_asking_where_the_run_is_gets_the_run_setup_and_an_old_one_is_refused(tmp_path, model_dir):  # noqa: F811
    core = make_core(tmp_path, model_dir, setup=SETUP)
    ask = P.Hello(protocol_version=P.PROTOCOL_VERSION, role="client", peer_id="setup",
                  capabilities={"request": SETUP_REQUEST})
    (peer, w), = core.handle(b"S", ask)
    assert peer == b"S" and isinstance(w, P.Welcome) and w.run_setup() == SETUP
    (_, r), = core.handle(b"S", P.Hello(protocol_version="1.2", role="client", peer_id="setup",
                                        capabilities={"request": SETUP_REQUEST}))
    assert isinstance(r, P.Reject) and core.counters["control/rejected_hello"] == 0
    # a core given no setup treats the request as any client's Hello: refused
    (_, r), = make_core(tmp_path / "b", model_dir).handle(b"S", ask)
    assert isinstance(r, P.Reject) and "role 'client' cannot join" in r.reason


def test_each_learner_version_is_one_metrics_row_and_a_stop_on_alarm_ends_training(tmp_path, model_dir):  # noqa: F811
    core = make_core(tmp_path, model_dir, extra=["learner.stop_on=[nonfinite]"])
    core.report = report_for(tmp_path, core.cfg)
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    for a in [m for _, m in out if isinstance(m, P.RolloutAssignment)]:
        answer(core, a)
    (_, batch), = core.handle(b"L", P.BatchRequest(step=0))
    assert isinstance(batch, P.TrainBatch)
    # a stranger's version is refused and not logged
    assert core.handle(b"X", P.VersionUpdate(version=1, metrics={"actor/loss": 9.0}))[0][1].code == "not_learner"
    core.handle(b"L", P.VersionUpdate(version=1, metrics={"actor/loss": 0.5, "transport/weights/bytes": 10.0},
                                      checkpoint=True))
    assert core.batches.stop_reason is None
    (_, batch), = core.handle(b"L", P.BatchRequest(step=1))
    core.handle(b"L", P.VersionUpdate(version=2, metrics={**batch.metrics, "actor/nonfinite_loss": 1.0}))
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2] and rows[0]["actor/loss"] == 0.5 and rows[0]["checkpoint"] == 1.0
    assert rows[0]["controller/samples_logged"] == core.samples_logged and rows[0]["transport/control/recv"] == 3.0
    assert rows[0]["throughput/samples_per_s"] > 0 and rows[1]["time/wall_s"] >= rows[0]["time/wall_s"] >= 0
    assert [a["alarm"] for a in read_alarms(tmp_path)] == ["nonfinite"]
    (_, stop), = core.handle(b"L", P.BatchRequest(step=2))  # the next request: ends like learner.time_budget_s
    assert isinstance(stop, P.Shutdown) and "health alarm nonfinite at step 2 (learner.stop_on)" in stop.reason
    core.finish()
    core.close()
    final = json.loads(RunDir(tmp_path).controller_final.read_text())
    assert final["samples_logged"] == core.samples_logged and final["transport/weights/bytes"] == 10.0
    assert final["transport/control/recv"] == 3.0 and "max_consumed_staleness" in final
    assert read_state(RunDir(tmp_path).controller_final_checkpoint)["samples_logged"] == core.samples_logged


def test_zero_variance_is_decided_once_and_drives_the_filter_and_the_batch_metric(tmp_path, model_dir):  # noqa: F811
    core = make_core(tmp_path, model_dir, eta=0, extra=["algo.dynamic_sampling=true"])
    register(core)
    out = core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
    first, second = [m for _, m in out if isinstance(m, P.RolloutAssignment)]
    answer(core, first, correct=(False,) * 4)  # all wrong: zero variance, filtered (its slot freed)
    answer(core, second)
    assert core.counters["data/filtered_groups"] == 0 and core.assembler.try_assemble() is None
    assert [g.scored().zero_variance for g in core.buffer.complete_groups()] == [False]
    replacement = [m for _, m in core.handle(b"W", P.WorkRequest(worker_id="w", credits=64))
                   if isinstance(m, P.RolloutAssignment)]
    for a in replacement:
        answer(core, a)
    (_, batch), = core.handle(b"L", P.BatchRequest(step=0))
    assert batch.metrics["data/filtered_groups"] == 1.0 and batch.metrics["train/zero_variance_groups"] == 0.0


def test_scores_of_a_state_from_an_older_run_are_read_from_its_untyped_annotation():
    assert Scores.from_state({}) is None and Scores.from_state(None) is None
    old = Scores.from_state({"rewards": [1, 1], "advantages": [0.0, 0.0]})
    assert old == Scores((1.0, 1.0), (0.0, 0.0), zero_variance=True)
    new = Scores((1.0, 0.0), (0.7, -0.7), zero_variance=False)
    assert Scores.from_state(json.loads(json.dumps(new.state()))) == new
