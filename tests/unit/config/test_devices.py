"""One device grammar (``asyncrl.config.devices.parse_device``) for the run's keys, the worker's ``rollout.device=``,
the engine factory and the launcher's GPU placement, with one refusal naming every valid spelling."""

from __future__ import annotations

import pytest

from asyncrl.config.devices import Device, parse_device
from asyncrl.config.loader import load_train_config
from asyncrl.config.roles import WorkerRoleConfig, parse_role
from asyncrl.engine.factory import resolve_device
from workers.gpus import gpu_plan


@pytest.mark.parametrize("text, device, may_use_gpu", [
    ("auto", Device("auto"), True), ("cpu", Device("cpu"), False), ("cuda", Device("cuda"), True),
    ("cuda:0", Device("cuda", 0), False), ("cuda:12", Device("cuda", 12), False),
])
def test_valid_spellings_parse_and_print_back(text, device, may_use_gpu):
    assert parse_device(text) == device and device.text == text
    assert device.may_use_gpu is may_use_gpu and device.pinned is (device.index is not None)


@pytest.mark.parametrize("text", ["gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "auto:1", "CUDA", "", "mps"])
def test_anything_else_is_refused_with_the_one_message(text):
    with pytest.raises(ValueError, match=r"is not a device; choose auto, cpu, cuda or cuda:N \(N = GPU index\)"):
        parse_device(text, key="rollout.device")
    with pytest.raises(ValueError, match="is not a device; choose auto, cpu or cuda$"):
        parse_device(text, key="learner.device", indexed=False)


def test_keys_without_an_index_refuse_cuda_n():
    with pytest.raises(ValueError, match="learner.device='cuda:1' is not a device; choose auto, cpu or cuda"):
        parse_device("cuda:1", key="learner.device", indexed=False)


@pytest.mark.parametrize("apply", [
    lambda text: load_train_config([f"rollout.device={text}"]),
    lambda text: parse_role(WorkerRoleConfig, ["controller=tcp://h:1", f"rollout.device={text}"], command="worker"),
    resolve_device,
])
def test_the_run_the_worker_and_the_engine_factory_share_the_grammar(apply):
    with pytest.raises(ValueError, match="'gpu1' is not a device; choose auto, cpu, cuda or cuda:N"):
        apply("gpu1")


def test_gpu_placement_reads_devices_through_the_grammar():
    assert gpu_plan(["0", "1"], load_train_config(["rollout.device=cuda", "learner.device=cpu"])) == (None, ["0", "1"])
    assert gpu_plan(["0", "1"], load_train_config(["rollout.device=cuda:1"]))[1] == [None, None]
    assert gpu_plan(["0", "1", "2"], load_train_config(["learner.device=cuda"]))[0] == "0"
