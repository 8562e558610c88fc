"""A worker's settings, from the run's config to its engine: ``Launcher.worker_args`` writes them, ``asyncrl
worker`` parses them back (``asyncrl.config.roles``) and the worker builds its ``EngineSpec`` from them.

The round trip is checked for every ``SGLangConfig`` field at a non-default value, so a key added to the
schema reaches the engine of a launched worker with no other edit. The role commands refuse bad settings
like ``asyncrl train`` (unknown key with "did you mean", types, ranges, devices), also in a real process.
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import protocols as P
from asyncrl.config.loader import load_train_config
from asyncrl.config.roles import (
    LearnerRoleConfig,
    WorkerRoleConfig,
    WorkerSGLangConfig,
    parse_role,
    role_dotlist,
    role_keys,
    worker_role_for_run,
)
from asyncrl.config.schema import SGLangConfig
from asyncrl.engine.factory import EngineSpec
from workers.generator.args import engine_spec, parse_args
from workers.launcher import Launcher

ROOT = Path(__file__).resolve().parents[3]
SETUP = P.WorkerSetup(samples_address="tcp://h:1", weights_announce="tcp://h:2", weights_fetch="tcp://h:3",
                      model_config='{"model_type": "qwen2"}', worker_slots=16, heartbeat_s=1.0, quant_format="fp32",
                      eos_token_ids=[2, 7], model_dir="/models/run", max_seq_len=64, quantize_head=False)


def _other_value(kind: typing.Any, default: typing.Any) -> str:
    """An override text setting a field of type ``kind`` to a value other than ``default``."""
    if kind is bool:
        return str(not default).lower()
    if kind is int:
        return str(default + 7)
    if kind is float:
        return str(default + 2.5)
    if typing.get_origin(kind) is list:  # elements a comma or YAML would split or reinterpret, kept whole
        return "['--json-model-override-args={\"a\": [1, 2]}', 'x,y', 'true', '']"
    return "/opt/sgl/bin/python" if default == "" else "cpu"


def _sglang_overrides() -> list[str]:
    hints = typing.get_type_hints(SGLangConfig)
    defaults = SGLangConfig()
    return [f"sglang.{f.name}={_other_value(hints[f.name], getattr(defaults, f.name))}"
            for f in dataclasses.fields(SGLangConfig)]


def _argv(cfg, tmp_path: Path, name: str = "worker-0") -> list[str]:
    launcher = Launcher(cfg, tmp_path, tmp_path)
    launcher.address = "tcp://127.0.0.1:5555"
    argv = launcher.worker_args(name)
    assert argv[:3] == [sys.executable, "-m", "workers.generator"]
    return argv[3:]


def test_every_sglang_setting_of_the_run_reaches_a_launched_workers_engine(tmp_path: Path):
    cfg = load_train_config(["rollout.engine=sglang", "quant.fmt=bf16", "rollout.num_workers=1",
                             f"transport.keys_dir={tmp_path}", *_sglang_overrides()])
    assert cfg.sglang != SGLangConfig()  # every field differs from its default
    for f in dataclasses.fields(SGLangConfig):
        assert getattr(cfg.sglang, f.name) != getattr(SGLangConfig(), f.name), f.name
    role = parse_args(_argv(cfg, tmp_path))
    assert role == worker_role_for_run(cfg, controller="tcp://127.0.0.1:5555", worker_id="worker-0",
                                       log_dir=str(tmp_path / "logs"))
    spec = engine_spec(SETUP, role, fmt="bf16", slots=16)
    assert spec == EngineSpec(kind="sglang", quant_format="bf16", device="auto", slots=16, eos_token_ids=[2, 7],
                              max_seq_len=64, model_config_json='{"model_type": "qwen2"}', model_path="/models/run",
                              sglang=cfg.sglang, log_dir=str(tmp_path / "logs"))
    assert spec.sglang.extra_args == ['--json-model-override-args={"a": [1, 2]}', "x,y", "true", ""]
    assert role.transport.keys_dir == str(tmp_path) and role.quant.fmt == ""  # the controller decides it


def test_a_native_workers_decode_options_and_device_round_trip(tmp_path: Path):
    cfg = load_train_config(["rollout.device=cpu", "rollout.decode_step=eager", "rollout.cuda_graphs=false",
                             "rollout.compile=true", "rollout.prewarm=false", "rollout.overlap=false"])
    argv = _argv(cfg, tmp_path, name="w:1")
    assert {"rollout.engine=native", "rollout.device=cpu", "rollout.decode_step=eager", "rollout.prewarm=false",
            "rollout.overlap=false", "rollout.cuda_graphs=false", "rollout.compile=true", "worker_id=w:1", "quant.fmt="} <= set(argv)
    role = parse_args(argv)
    assert role == worker_role_for_run(cfg, controller="tcp://127.0.0.1:5555", worker_id="w:1",
                                       log_dir=str(tmp_path / "logs"))
    assert role.quant.fmt == "" and role.worker_id == "w:1"  # empty: the run's format, from the controller
    spec = engine_spec(SETUP, role, fmt="int8", slots=8)
    assert spec == EngineSpec(kind="native", quant_format="int8", device="cpu", slots=8, eos_token_ids=[2, 7],
                              max_seq_len=64, model_config_json='{"model_type": "qwen2"}', model_path="/models/run",
                              decode_step="eager", cuda_graphs="false", compile_step="true", prewarm="false", overlap="false",
                              log_dir=str(tmp_path / "logs"))
    assert parse_role(WorkerRoleConfig, role_dotlist(role), command="worker") == role


@pytest.mark.parametrize("settings, expected", [
    (["sglang.extra_args=[--attention-backend,triton]"], {"sglang.extra_args": ["--attention-backend", "triton"]}),
    (["sglang.extra_args=--attention-backend,triton"], {"sglang.extra_args": ["--attention-backend", "triton"]}),
    (["sglang.extra_args="], {"sglang.extra_args": []}),
    (["rollout.compile=false", "rollout.device=cpu", "rollout.cuda_graphs=true"],
     {"rollout.compile": "false", "rollout.device": "cpu", "rollout.cuda_graphs": "true"}),
    (["sglang.url=http://gen-3:30000", "rollout.engine=sglang", "quant.fmt=fp8"],
     {"sglang.url": "http://gen-3:30000", "rollout.engine": "sglang", "quant.fmt": "fp8"}),
    (["rollout.device=cuda:1", "rollout.worker_slots=64", "worker_id=gpu-3", "log_level=debug", "no_learner_s=2"],
     {"rollout.device": "cuda:1", "rollout.worker_slots": 64, "worker_id": "gpu-3", "log_level": "DEBUG",
      "no_learner_s": 2.0}),
    (["sglang.model_path=/data/m", "transport.keys_dir=~/keys", "transport.key_name=gen", "log_dir="],
     {"sglang.model_path": "/data/m", "transport.keys_dir": "~/keys", "transport.key_name": "gen", "log_dir": ""}),
])
def test_the_command_lines_of_the_docs_and_tests_keep_their_meaning(settings, expected):
    role = parse_args(["controller=tcp://HOST:5555", *settings])
    for key, value in expected.items():
        node = role
        for part in key.split("."):
            node = getattr(node, part)
        assert node == value, key


@pytest.mark.parametrize("settings, message", [
    (["controller=tcp://h:1", "slots=4"], "unknown configuration key 'slots'.*did you mean rollout.worker_slots\\?"),
    (["controller=tcp://h:1", "decode_step=eager"], "did you mean rollout.decode_step\\?"),
    (["controller=tcp://h:1", "engine=sglang"], "unknown configuration key 'engine'.*did you mean rollout.engine\\?"),
    (["controller=tcp://h:1", "device=cpu"], "unknown configuration key 'device'.*did you mean rollout.device\\?"),
    (["controller=tcp://h:1", "sglang.urll=x"], "did you mean sglang.url\\?.*`asyncrl worker --help`"),
    (["controller=tcp://h:1", "rollout.compile"], "'rollout.compile' is not key=value"),
    (["controller=tcp://h:1", "rollout.worker_slots=many"],
     "rollout.worker_slots=many is not an int; it must be a whole number.*allowed: >= 0"),
    (["controller=tcp://h:1", "rollout.compile=maybe"], "rollout.compile='maybe' is not valid; choose one of: auto, true, false"),
    (["controller=tcp://h:1", "rollout.worker_slots=-1"], "rollout.worker_slots=-1 must be >= 0"),
    (["controller=tcp://h:1", "sglang.startup_timeout_s=0"], "sglang.startup_timeout_s=0.0 must be > 0"),
    (["controller=tcp://h:1", "no_learner_s=nan"], "no_learner_s=nan is not a finite number"),
    (["controller=tcp://h:1", "rollout.device=gpu1"], "rollout.device='gpu1' is not a device; choose auto, cpu, cuda or cuda:N"),
    (["controller=tcp://h:1", "sglang.device=cuda:0"], "sglang.device='cuda:0' is not a device; choose auto, cpu or"),
    (["controller=tcp://h:1", "rollout.engine=vllm"], "rollout.engine='vllm' is not valid; choose one of: native, sglang"),
    (["controller=tcp://h:1", "rollout.decode_step=fast"], "rollout.decode_step='fast' is not valid"),
    (["controller=tcp://h:1", "quant.fmt=int3"], "quant.fmt='int3' is not valid"),
    (["controller=tcp://h:1", "rollout.engine=sglang", "quant.fmt=int8"], "start it with quant.fmt=fp32"),
    (["controller=tcp://h:1", "log_level=loud"], "log_level='LOUD' is not valid"),
    (["controller=tcp://h:1", "sglang=x"], "sglang is a section of settings"),
    (["worker_id=w"], "controller=tcp://HOST:PORT is required"),
])
def test_bad_worker_settings_are_refused_naming_the_fix(settings, message):
    with pytest.raises(ValueError, match=message):
        parse_args(settings)


def test_learner_settings_are_parsed_by_the_same_rules():
    role = parse_role(LearnerRoleConfig, ["controller=tcp://h:1", "run_dir=/shared/runs/x", "transport.key_name=l"],
                      command="learner")
    assert (role.controller, role.run_dir, role.model_dir, role.transport.key_name) == (
        "tcp://h:1", "/shared/runs/x", "", "l")
    with pytest.raises(ValueError, match="did you mean model_dir\\?.*`asyncrl learner --help`"):
        parse_role(LearnerRoleConfig, ["controller=tcp://h:1", "model_dri=/m"], command="learner")
    with pytest.raises(ValueError, match="controller=tcp://HOST:PORT is required"):
        parse_role(LearnerRoleConfig, ["run_dir=/r"], command="learner")


@pytest.mark.parametrize("command, schema", [("worker", WorkerRoleConfig), ("learner", LearnerRoleConfig)])
def test_help_lists_every_key_with_its_meaning(command, schema, capsys):
    from workers.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for key in role_keys(schema):
        line = next((ln for ln in lines if ln.strip().startswith(f"{key}=")), None)
        assert line is not None, key
        assert len(line.split(None, 1)) == 2, line  # key=FORM, then its meaning


@pytest.mark.parametrize("entry, command, settings, message", [
    (["-m", "asyncrl", "worker"], "worker", ["controller=tcp://127.0.0.1:9", "slots=4"],
     "did you mean rollout.worker_slots?"),
    (["-m", "asyncrl", "worker"], "worker", ["controller=tcp://127.0.0.1:9", "device=cpu"],
     "did you mean rollout.device?"),
    (["-m", "workers.generator"], "worker", ["controller=tcp://127.0.0.1:9", "rollout.slotz=4"],
     "did you mean rollout.worker_slots?"),
    (["-m", "asyncrl", "learner"], "learner", ["controller=tcp://127.0.0.1:9", "rundir=/r"], "did you mean run_dir?"),
])
def test_a_role_command_with_a_bad_key_exits_2_saying_the_fix(procs, entry, command, settings, message):
    # `python -m workers.generator` is how `asyncrl train` starts its workers: the same one line
    proc = procs.python(*entry, *settings, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out, err = proc.communicate(timeout=120)
    text = err.decode()
    assert proc.returncode == 2, text
    assert text.startswith(f"asyncrl {command}: unknown configuration key") and message in text, text
    assert "Traceback" not in text and not out


@pytest.mark.parametrize("text", ["null", "true", "~", "1:30", "[x]", "{a: 1}", "#c", "a # b", " lead", "trail ",
                                  '"q"', "'s'", "it's", "x=y", "${oc.env:HOME}", "a${b}c", "é", "0x10", "1e3", "-",
                                  "--flag", ""])
def test_text_settings_round_trip_verbatim(text):
    role = WorkerRoleConfig(controller="tcp://h:1", worker_id=text, log_dir=text,
                            sglang=WorkerSGLangConfig(python=text, extra_args=[text, f"{text},z"]))
    assert parse_role(WorkerRoleConfig, role_dotlist(role), command="worker") == role
