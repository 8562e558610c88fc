"""The controller process never loads torch (about 0.25 GB of resident memory beside a run): its
imports, its scorer (tokenizer by class name, advantages by ``asyncrl.algo.outcome``) and the model
description it sends workers."""

from __future__ import annotations

import json
import subprocess
import sys

from asyncrl.models import ensure_tiny_model
from asyncrl.tasks.prompts import load_tokenizer, tokenizer_class_name

PROBE = """
import json, sys
from pathlib import Path
import numpy as np
import protocols as P
import workers.controller as wc
from asyncrl.config.loader import load_train_config
from asyncrl.controller.core import score_group
from asyncrl.tasks.scoring import build_scorer
folder, name = Path(sys.argv[1]), sys.argv[2]
cfg = load_train_config(["task=addition"])
scorer = build_scorer(cfg, folder, tokenizer_class=name)
meta = scorer.problem(3)

def sample(ids):
    arr = lambda x, t: P.Array.from_numpy(np.asarray(x, dtype=t))
    return P.FinishedSample(sample_id="g/0", group_id="g", prompt_ids=arr(meta["prompt_ids"], np.int32),
                            response_ids=arr(ids, np.int32), behav_logp=arr([-1.0] * len(ids), np.float32),
                            versions=arr([0] * len(ids), np.int32), finish_reason="stop", worker_id="w0")

scores = score_group(scorer, cfg.algo.advantage, meta, [sample(scorer.encode(meta["answer"])), sample(scorer.encode("x"))])
rewards, adv = scores.rewards, scores.advantages
info = wc.model_info(cfg, folder)
print(json.dumps({"torch": "torch" in sys.modules, "rewards": rewards, "adv": adv, "eos": list(info.eos_token_ids),
                  "vocab": json.loads(info.config_json)["vocab_size"]}))
"""


def test_controller_scores_and_describes_the_model_without_torch(tmp_path):
    folder = ensure_tiny_model(tmp_path / "tiny")
    name = tokenizer_class_name(load_tokenizer(folder))
    res = subprocess.run([sys.executable, "-c", PROBE, str(folder), name], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    assert got["rewards"][0] == 1.0 and got["rewards"][1] == 0.0
    assert got["adv"][0] > 0 > got["adv"][1]
    assert got["eos"] and got["vocab"] == json.loads((folder / "config.json").read_text())["vocab_size"]
