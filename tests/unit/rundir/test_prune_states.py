"""Controller states (``checkpoints/controller-NNNNNNNN.json``) are pruned like the learner's checkpoints:
the newest ``KEEP_CHECKPOINTS`` stay, and so does every state a learner checkpoint pairs with, version 0
and ``controller-final.json``."""

from __future__ import annotations

import pytest

import protocols as P
from asyncrl.config.loader import load_train_config
from asyncrl.controller.core import ControllerCore, ModelInfo
from asyncrl.models import ensure_tiny_model
from asyncrl.rundir import RunDir
from asyncrl.rundir.checkpoints import KEEP_CHECKPOINTS, choose_resume_point, prune_controller_states
from asyncrl.rundir.files import write_checksummed_json
from asyncrl.rundir.paths import learner_checkpoint_name
from asyncrl.tasks.scoring import build_scorer


def versions(root):
    return sorted(int(p.name[11:19]) for p in root.glob("controller-*.json") if p.name != "controller-final.json")


def test_prune_keeps_the_newest_the_paired_version_0_and_final(tmp_path):
    run = RunDir(tmp_path)
    run.checkpoints.mkdir()
    for v in (0, 10, 20, 30, 40, 50, 60):
        write_checksummed_json(run.controller_checkpoint(v), {"v": v})
    write_checksummed_json(run.controller_final_checkpoint, {})
    run.learner_checkpoint(20).mkdir()  # an old learner checkpoint still on disk
    (run.checkpoints / (learner_checkpoint_name(30) + ".tmp")).mkdir()  # one being written
    removed = prune_controller_states(run.checkpoints, keep=2)
    assert versions(run.checkpoints) == [0, 20, 30, 50, 60]
    assert sorted(p.name for p in removed) == ["controller-00000010.json", "controller-00000040.json"]
    assert run.controller_final_checkpoint.exists()
    assert prune_controller_states(tmp_path / "missing") == []
    with pytest.raises(ValueError, match="keep=0 must be >= 1"):
        prune_controller_states(run.checkpoints, keep=0)


def test_the_controller_prunes_its_states_as_the_learner_checkpoints(tmp_path):
    model_dir = ensure_tiny_model(tmp_path / "tiny")
    run = tmp_path / "run"
    run.mkdir()
    cfg = load_train_config(["algo.group_size=4", "rollout.groups_per_step=2", "rollout.worker_slots=8",
                             "log.fsync=never"])
    core = ControllerCore(cfg, run_dir=run, scorer=build_scorer(cfg, model_dir), samples_address="tcp://c:9",
                          model=ModelInfo(config_json=(model_dir / "config.json").read_text(), eos_token_ids=(2,),
                                          model_id="tiny:test", model_dir=str(model_dir)),
                          publish_formats=["int8"])
    try:
        ckpts = RunDir(run).checkpoints
        core.save(core.checkpoint_path(0))  # as workers/controller.py does when a run starts
        core.handle(b"L", P.Hello(protocol_version=P.PROTOCOL_VERSION, role="learner", peer_id="learner", version=0,
                                  capabilities={"weights_announce": "tcp://l:1", "weights_fetch": "tcp://l:2"}))
        for v in range(2, 22, 2):
            core.handle(b"L", P.VersionUpdate(version=v, checkpoint=True))
            # the learner then saves its checkpoint of v and keeps the newest KEEP_CHECKPOINTS
            (ckpts / learner_checkpoint_name(v)).mkdir()
            for old in sorted(ckpts.glob("step_*"))[:-KEEP_CHECKPOINTS]:
                old.rmdir()
        kept = [int(p.name[5:]) for p in sorted(ckpts.glob("step_*"))]
        assert kept == [16, 18, 20]
        # 14 paired with a learner checkpoint when 20 was saved; it goes at the next save
        assert versions(ckpts) == [0, 14, 16, 18, 20]
        core.handle(b"L", P.VersionUpdate(version=22, checkpoint=True))
        assert versions(ckpts) == [0, 16, 18, 20, 22]  # never more than KEEP_CHECKPOINTS + 1 besides 0
        assert choose_resume_point(ckpts, controller_state=True).controller_state is not None
    finally:
        core.close()
