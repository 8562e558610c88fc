#!/usr/bin/env python
"""TRL's GRPOTrainer on an asyncrl task, for ``scripts/bench_real.py`` (runs in the TRL venv, never in asyncrl's).

``python scripts/trl_grpo.py SPEC.json`` with the repository on ``PYTHONPATH`` (for ``asyncrl.tasks``,
which imports no torch: the reward is asyncrl's own task scorer). The spec, written by bench_real from
an asyncrl run's resolved configuration, fixes the model folder, the task and its arguments, the
prompt format, and the sizes: group size G (``num_generations``), prompts per step B, max new tokens,
temperature, learning rate and warm-up, micro-batch, clip range, gradient clip, weight decay,
activation checkpointing and bf16 autocast (as the asyncrl learner has them), seed, torch threads and
the time budget.

Mapping to TRL (trl==1.16.0): one optimizer step per generation of B x G completions
(``per_device_train_batch_size`` = micro-batch, ``gradient_accumulation_steps`` = B x G / micro-batch,
``steps_per_generation`` = the same), ``num_iterations=1``, ``loss_type="dapo"`` (token mean over the
batch, like asyncrl's token-mean), ``scale_rewards="group"`` (GRPO), ``beta=0`` (no reference model),
prompts in the order of asyncrl's training stream (``shuffle_dataset=False``), AdamW with torch's
defaults and asyncrl's warm-up rule (step s < warmup: lr x (s+1)/warmup, then constant). Prompts go to
TRL as chat messages (or raw text), and the runner checks that TRL tokenizes the first ones to exactly
the ids asyncrl's controller sends (``check_prompt_ids``).

Writes to ``metrics`` a JSON line ``train_begin`` (wall time), then one per optimizer step (``step``,
``time``, ``reward``, ``generate_s``, ``completion_tokens``), and at the end the trained model to ``out_dir`` (an HF folder). Stops at the
first step end past ``time_budget_s`` (counted from the start of training, model loading excluded).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.tasks import make_task

    task = make_task(spec["task_name"], **spec["task_kwargs"])
    G, B, mbs = int(spec["group_size"]), int(spec["groups_per_step"]), int(spec["micro_batch_size"])
    batch = G * B
    if batch % mbs:
        raise ValueError(f"micro_batch_size={mbs} must divide the batch G x B = {batch} for TRL's accumulation")
    chat = spec["prompt_format"] == "chat"

    def as_prompt(text: str):
        if not chat:
            return text
        head = [{"role": "system", "content": spec["system_prompt"]}] if spec["system_prompt"] else []
        return head + [{"role": "user", "content": text}]

    n_rows = min(task.train_size, 4096)  # asyncrl's stream order; TRL cycles it when a long run needs more
    dataset = Dataset.from_list([{"prompt": as_prompt(task.problem_at(i).prompt), "position": i}
                                 for i in range(n_rows)])

    def reward(prompts, completions, position, **_):
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [float(task.score(task.problem_at(int(p)), t)) for p, t in zip(position, texts, strict=True)]

    reward.__name__ = "asyncrl_task_score"
    model_dir = spec["model_dir"]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=float(spec["lr"]),
                            weight_decay=float(spec["weight_decay"]))
    warm = int(spec["warmup_steps"])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else 1.0)
    args = GRPOConfig(
        output_dir=str(Path(spec["out_dir"]).parent / "trl-output"), use_cpu=True, bf16=bool(spec["bf16"]), fp16=False,
        gradient_checkpointing=bool(spec["gradient_checkpointing"]),
        seed=int(spec["seed"]), learning_rate=float(spec["lr"]), max_grad_norm=float(spec["grad_clip"]),
        weight_decay=float(spec["weight_decay"]), per_device_train_batch_size=mbs,
        gradient_accumulation_steps=batch // mbs, num_generations=G, max_completion_length=int(spec["max_new_tokens"]),
        temperature=float(spec["temperature"]), top_p=1.0, top_k=0, num_iterations=1, beta=0.0,
        epsilon=float(spec["eps_low"]), epsilon_high=float(spec["eps_high"]), loss_type="dapo",
        scale_rewards="group", shuffle_dataset=False, max_steps=100_000, logging_steps=1, report_to="none",
        save_strategy="no", dataloader_num_workers=0, log_completions=False, disable_tqdm=True,
    )

    class Timed(GRPOTrainer):
        """GRPOTrainer unchanged, with the wall time of its generate calls recorded."""

        generate_s = 0.0

        def _generate(self, prompts):
            t0 = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                self.generate_s += time.perf_counter() - t0

    out = open(spec["metrics"], "w")  # noqa: SIM115 - closed below

    class Budget(TrainerCallback):
        """One metrics line per optimizer step; stops training at the first step end past the budget."""

        t0 = 0.0
        last_gen = 0.0

        def on_train_begin(self, args, state, control, **kw):
            self.t0 = time.monotonic()
            out.write(json.dumps({"train_begin": time.time()}) + "\n")

        def on_log(self, args, state, control, logs=None, **kw):
            logs = logs or {}
            if "reward" not in logs:
                return
            gen = trainer.generate_s - self.last_gen
            self.last_gen = trainer.generate_s
            tokens = float(logs.get("completions/mean_length", 0.0)) * batch
            out.write(json.dumps({"step": state.global_step, "time": time.time(), "reward": logs["reward"],
                                  "generate_s": gen, "completion_tokens": tokens,
                                  "lr": logs.get("learning_rate"), "loss": logs.get("loss")}) + "\n")
            out.flush()

        def on_step_end(self, args, state, control, **kw):
            if time.monotonic() - self.t0 >= float(spec["time_budget_s"]):
                control.should_training_stop = True

    trainer = Timed(model=model, reward_funcs=[reward], args=args, train_dataset=dataset, processing_class=tokenizer,
                    callbacks=[Budget()], optimizers=(opt, sched))
    # Same prompts: TRL's own tokenization of the first problems equals the ids asyncrl's controller sends.
    expected = spec.get("check_prompt_ids") or []
    got = trainer._tokenize_prompts([dataset[i]["prompt"] for i in range(len(expected))])[0]
    if [list(map(int, g)) for g in got] != expected:
        raise SystemExit(f"TRL tokenizes the prompts differently from asyncrl:\n{got[:1]}\nvs\n{expected[:1]}")
    t0 = time.monotonic()
    result = trainer.train()
    train_s = time.monotonic() - t0
    out.close()
    trainer.save_model(spec["out_dir"])
    tokenizer.save_pretrained(spec["out_dir"])
    summary = {"steps": int(result.global_step), "train_s": train_s, "generate_s": trainer.generate_s}
    (Path(spec["out_dir"]) / "trl_summary.json").write_text(json.dumps(summary))
    print(f"trl_grpo: {summary}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="the JSON spec bench_real.py writes")
    raise SystemExit(main(ap.parse_args().spec))
