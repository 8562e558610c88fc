"""LoRA policies (PEFT): adapters-only training, merged weights, KL reference, checkpoints, export."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from asyncrl.algo import ObjectiveConfig
from asyncrl.learner import (
    LRSchedule,
    StepConfig,
    TrainState,
    build_optimizer,
    build_scheduler,
    export_hf,
    load_checkpoint,
    save_checkpoint,
    train_step,
)
from asyncrl.learner.policy import (
    LoraSpec,
    base_model,
    checkpoint_decoder_layers,
    default_num_threads,
    policy_state_dict,
    prepare_policy,
    reference_policy,
)

SPEC = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "up_proj", "down_proj"))


def _lora_state(tiny, info, seed=0, tie=True, lr=5e-2):
    model = prepare_policy(tiny.model(seed=seed, tie=tie), info, lora=SPEC)
    opt = build_optimizer(model, lr=lr)
    return TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))


def _train(state, tiny, info, steps=2, objective=None):
    for v in range(steps):
        m = train_step(state, tiny.batch(6, seed=v, version=state.version), objective or tiny.objective,
                       StepConfig(), info, ref_model=state.model)  # fmt: skip
    return m


@pytest.mark.parametrize("tie", [True, False])
def test_merged_published_weights_give_the_adapter_models_logits(tiny, dist_info, tie):
    state = _lora_state(tiny, dist_info, tie=tie)
    base_before = {k: v.clone() for k, v in base_model(state.model).state_dict().items() if "lora_" not in k}
    _train(state, tiny, dist_info)
    assert any(n.endswith("lora_B.default.weight") and p.abs().max() > 0 for n, p in state.model.named_parameters())
    trainable = [n for n, p in state.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for k, v in base_model(state.model).state_dict().items():  # the base never moves
        if k in base_before:
            assert torch.equal(v, base_before[k]), k

    merged = policy_state_dict(state.model, SPEC)
    plain = tiny.model(seed=99, tie=tie)
    assert set(merged) == set(plain.state_dict())
    plain.load_state_dict(merged)
    batch = tiny.batch(5, seed=11)
    with torch.no_grad():
        want = state.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = plain(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    assert not torch.allclose(merged["model.layers.0.self_attn.q_proj.weight"],
                              base_before["model.layers.0.self_attn.q_proj.base_layer.weight"])  # fmt: skip


@pytest.mark.parametrize("fmt", ["int8", "nvfp4", "fp32"])
def test_publishing_the_lazily_merged_weights_equals_publishing_them_merged_at_once(tiny, dist_info, fmt):
    # The learner publishes the MergedLoraState as it is (each merged weight built, quantized and freed in
    # turn): the publication must be the one of the fully merged dict, tied weights included once, and a
    # merged weight built at the address of a freed one is not taken for a tied copy of it.
    from asyncrl.quant import publish

    state = _lora_state(tiny, dist_info, tie=True)
    _train(state, tiny, dist_info, steps=1)
    lazy = policy_state_dict(state.model, SPEC)
    assert not isinstance(lazy, dict)
    tied = lazy["lm_head.weight"]
    assert tied is lazy["lm_head.weight"]  # an unadapted weight: one view, the same at every read
    assert tied.data_ptr() == lazy["model.embed_tokens.weight"].data_ptr()
    eager = dict(lazy)
    a, b = publish(lazy, fmt, version=3), publish(eager, fmt, version=3)
    assert a.checksum == b.checksum
    assert [e.name for e in a.manifest] == [e.name for e in b.manifest]
    names = {e.name for e in a.manifest}
    assert len(names & {"lm_head.weight", "model.embed_tokens.weight"}) == 1, names  # tied: published once
    for name, t in b.tensors.items():
        assert torch.equal(a.tensors[name], t), name


def test_lora_kl_reference_is_the_base_without_adapters(tiny, dist_info):
    objective = ObjectiveConfig(objective="acr", kl_coef=0.1)
    state = _lora_state(tiny, dist_info)
    assert reference_policy(state.model, None, dist_info) is state.model
    first = train_step(state, tiny.batch(6, seed=1), objective, StepConfig(), dist_info, ref_model=state.model)
    assert first["actor/kl_ref"] == pytest.approx(0.0, abs=1e-9)  # adapters start at B = 0
    later = _train(state, tiny, dist_info, steps=3, objective=objective)
    assert later["actor/kl_ref"] > 1e-7 and later["actor/kl_loss"] > 0


def test_full_fine_tuning_reference_is_a_frozen_copy_of_the_initial_weights(tiny, dist_info):
    model = tiny.model(seed=2)
    ref = reference_policy(model, copy.deepcopy(model), dist_info)
    assert ref is not model and all(not p.requires_grad for p in ref.parameters())
    objective = ObjectiveConfig(objective="acr", kl_coef=0.1)
    opt = build_optimizer(model, lr=5e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    first = train_step(state, tiny.batch(6, seed=1), objective, StepConfig(), dist_info, ref_model=ref)
    assert first["actor/kl_ref"] == pytest.approx(0.0, abs=1e-9)
    later = train_step(state, tiny.batch(6, seed=2, version=1), objective, StepConfig(), dist_info, ref_model=ref)
    assert later["actor/kl_ref"] > 0


def test_lora_checkpoint_holds_adapters_only_and_round_trips(tiny, dist_info, tmp_path):
    state = _lora_state(tiny, dist_info)
    _train(state, tiny, dist_info)
    path = save_checkpoint(tmp_path, state, dist_info)
    import torch.distributed.checkpoint as dcp

    keys = dcp.FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in model_keys if "lora_" not in k]
    fresh = _lora_state(tiny, dist_info)
    load_checkpoint(tmp_path, fresh, dist_info)
    assert fresh.version == state.version
    a, b = policy_state_dict(state.model, SPEC), policy_state_dict(fresh.model, SPEC)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_export_of_a_lora_policy_is_the_merged_hf_model(tiny, dist_info, tmp_path):
    state = _lora_state(tiny, dist_info, tie=True)
    _train(state, tiny, dist_info)
    out = export_hf(state.model, None, tmp_path / "model", dist_info, lora=SPEC)
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    batch = tiny.batch(4, seed=5)
    with torch.no_grad():
        want = state.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
        got = loaded(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_bad_lora_settings_name_the_fix(tiny):
    with pytest.raises(ValueError, match="rank"):
        LoraSpec(rank=0, alpha=1, target_modules=("q_proj",))
    with pytest.raises(ValueError, match="lm_head"):
        LoraSpec(rank=2, alpha=1, target_modules=("lm_head",))
    from asyncrl.learner.policy import lora_targets
    from asyncrl.quant import quantize_model

    # a decoder without any linear layer (every projection swapped for an int8 module) names its linears
    with pytest.raises(ValueError, match=r"match no module.*\['lm_head'\]"):
        lora_targets(quantize_model(tiny.model(), "int8"), ("qkv_proj",))


def test_lora_targets_default_to_the_models_own_projections(tiny):
    from asyncrl.learner.policy import apply_lora, lora_targets

    own = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    targets, note = lora_targets(tiny.model(), ("query_key_value",))
    assert targets == own and "adapting the model's own" in note
    targets, note = lora_targets(tiny.model(), ("q_proj", "w1"))  # keep what exists, say what was dropped
    assert targets == ["q_proj"] and "['w1']" in note
    assert lora_targets(tiny.model(), ("q_proj", "v_proj")) == (["q_proj", "v_proj"], "")
    model = apply_lora(tiny.model(), LoraSpec(rank=2, alpha=1, target_modules=("qkv_proj",)))
    adapted = {n.split(".lora_A.")[0].split(".")[-1] for n, _ in model.named_parameters() if ".lora_A." in n}
    assert adapted == set(own)


def test_activation_checkpointing_changes_no_value_or_gradient(tiny, dist_info):
    batch = tiny.batch(6, seed=3)
    res = []
    for ac in (False, True):
        model = tiny.model(seed=4)
        if ac:
            assert checkpoint_decoder_layers(model) == 2
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
        m = train_step(state, batch, tiny.objective, StepConfig(grad_clip=0.0), dist_info)
        res.append((m, {k: v.clone() for k, v in model.state_dict().items()}))
    assert res[0][0]["learner/loss"] == res[1][0]["learner/loss"]
    assert all(torch.equal(res[0][1][k], res[1][1][k]) for k in res[0][1])


def test_default_threads_leave_one_cpu_per_worker():
    assert default_num_threads(2, 1, cpus=16) == 14
    assert default_num_threads(2, 2, cpus=16) == 7
    assert default_num_threads(4, 1, cpus=2) == 1


def test_lora_dropout_is_active_in_the_training_forward_only(tiny, dist_info):
    spec = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj"), dropout=0.5)
    model = prepare_policy(tiny.model(seed=1), dist_info, lora=spec)
    opt = build_optimizer(model, lr=5e-2)
    state = TrainState(model=model, optimizer=opt, scheduler=build_scheduler(opt, LRSchedule()))
    train_step(state, tiny.batch(6, seed=0), tiny.objective, StepConfig(reuse_prox=False, train_dropout=True), dist_info)
    seen = []

    def recording(logp, prox, *a, **kw):
        seen.append((logp.detach().clone(), prox.clone()))
        from asyncrl.algo import policy_loss

        return policy_loss(logp, prox, *a, **kw)

    batch = tiny.batch(6, seed=1, version=1)
    train_step(state, batch, tiny.objective, StepConfig(reuse_prox=False, train_dropout=True), dist_info,
               loss_fn=recording)  # fmt: skip
    logp, prox = seen[0]
    assert not torch.allclose(logp, prox)  # dropout on the adapters' input in the training forward
    assert not state.model.training  # eval mode again after the step
    with pytest.raises(ValueError, match="reuse_prox"):
        StepConfig(train_dropout=True)
