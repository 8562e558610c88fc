"""Typed settings of the role commands ``asyncrl worker`` and ``asyncrl learner``, parsed like ``asyncrl train``.

Owns: ``WorkerRoleConfig`` and ``LearnerRoleConfig`` (every ``key=value`` setting of those commands, its
default and a docstring under it), ``parse_role`` (``key=value`` -> a checked role config, through the
OmegaConf dotlist and ``asyncrl.config.loader``'s unknown-key check with its "did you mean"),
``role_dotlist`` (its inverse: the ``key=value`` list that parses back to the same config),
``worker_role_for_run`` (the worker a launcher starts for a ``TrainConfig``), ``worker_formats`` (a worker's
actor and fetched formats, decided by the controller) and ``settings_help``
(the one line per key of ``--help``, from the field docstrings here).
Never: parses argv with argparse (``--help`` is workers/role_cli.py's), imports torch or zmq, or keeps a second
copy of a run setting: the worker's ``sglang`` section is the run's ``SGLangConfig`` plus ``model_path``.

Invariant: ``parse_role(type(c), role_dotlist(c))`` equals ``c`` for every valid role config ``c``, so a
key added to a role schema (or to ``SGLangConfig``) reaches the processes a launcher starts unchanged.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
import re
import textwrap
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from asyncrl.config.devices import parse_device
from asyncrl.config.loader import check_known_keys, schema_keys, structured, type_error
from asyncrl.config.ranges import WORKER_RANGES, check_ranges
from asyncrl.config.schema import (
    ENGINES,
    SGLANG_SERVING,
    SGLangConfig,
    TrainConfig,
    check_decode_options,
    check_serving,
    sglang_wire_format,
)
from protocols.values import FORMATS as QUANT_FORMATS
from protocols.values import require_choice

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
Role = TypeVar("Role")


@dataclass(kw_only=True)
class WorkerSGLangConfig(SGLangConfig):
    """The run's ``sglang.*`` settings, plus where this host keeps the model a started server loads."""

    model_path: str = ""
    """``DIR``: the model folder a server this worker starts loads (default: the run's, from the controller)."""


@dataclass(kw_only=True)
class RoleQuantConfig:
    fmt: str = ""
    """``FMT``: actor format (native: a published format; sglang: fp32, bf16 or fp8). Default: the run's
    ``quant.fmt`` (an SGLang worker: fp32 when SGLang does not serve the run's); see ``worker_formats``."""


@dataclass(kw_only=True)
class RoleRolloutConfig:
    engine: str = "native"
    """``native|sglang``: rollout engine (default native)."""
    device: str = "auto"
    """``auto|cpu|cuda[:N]``: native engine device (default auto: a GPU when one is visible)."""
    worker_slots: int = 0
    """``N``: concurrent samples (0: the run's rollout.worker_slots)."""
    decode_step: str = "auto"
    """``auto|static|eager``: native decode step."""
    cuda_graphs: str = "auto"
    """``auto|true|false``: native engine CUDA graphs of the static step."""
    compile: str = "auto"
    """``auto|true|false``: native engine ``torch.compile`` of the static step (auto: Inductor on CUDA, falling
    back to the uncompiled step with an error logged if compiling fails; off on a CPU)."""
    overlap: str = "auto"
    """``auto|true|false``: native engine reads a step's results after launching the next (auto: on CUDA)."""
    prewarm: str = "auto"
    """``auto|true|false``: native engine builds every bucket of the static step at start (auto: with CUDA
    graphs or a compiled step)."""


@dataclass(kw_only=True)
class RoleTransportConfig:
    keys_dir: str = ""
    """``DIR``: CurveZMQ client keys from ``asyncrl keys generate`` (docs/security.md)."""
    key_name: str = ""
    """``NAME``: which client key of ``keys_dir`` to use (default: the first)."""


@dataclass(kw_only=True)
class WorkerRoleConfig:
    """``asyncrl worker key=value ...``: one generation worker joining a running job (docs/cluster.md)."""

    controller: str = ""
    """``tcp://HOST:PORT``: required; the address `asyncrl train` / `asyncrl controller` prints."""
    worker_id: str = ""
    """``NAME``: this worker's name in the controller's logs and metrics (default: host-pid)."""
    drain_s: float = 10.0
    """``S``: on SIGTERM or Shutdown, how long in-flight samples may finish before the rest is aborted and
    handed back."""
    no_learner_s: float = 120.0
    """``S``: how long to wait for a learner when a restarted controller has none. A joined worker keeps
    asking a controller that answers ``not_ready`` (it restarted, and no learner has rejoined it yet) this
    long before it leaves, saying which role to restart."""
    log_level: str = "INFO"
    """``DEBUG|INFO|WARNING|ERROR``: logging level."""
    log_dir: str = ""
    """``DIR``: where a started SGLang server writes its log (default: the temp folder)."""
    rollout: RoleRolloutConfig = field(default_factory=RoleRolloutConfig)
    quant: RoleQuantConfig = field(default_factory=RoleQuantConfig)
    transport: RoleTransportConfig = field(default_factory=RoleTransportConfig)
    sglang: WorkerSGLangConfig = field(default_factory=WorkerSGLangConfig)


@dataclass(kw_only=True)
class LearnerRoleConfig:
    """``asyncrl learner key=value ...``: one learner rank of a run whose controller already serves."""

    controller: str = ""
    """``tcp://HOST:PORT``: required; the address `asyncrl controller` prints."""
    run_dir: str = ""
    """``DIR``: the run folder on this host (default: the controller's path, on a shared filesystem)."""
    model_dir: str = ""
    """``DIR``: the model folder on this host (default: the controller's path, on a shared filesystem)."""
    transport: RoleTransportConfig = field(default_factory=RoleTransportConfig)


def _leaf_types(schema: type, prefix: str = "") -> dict[str, Any]:
    """Every dotted leaf key of ``schema`` -> its annotated type (``str``, ``list[str]``, ...)."""
    out: dict[str, Any] = {}
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            out |= _leaf_types(kind, f"{prefix}{f.name}.")
        else:
            out[f"{prefix}{f.name}"] = kind
    return out


def _is_list(kind: Any) -> bool:
    return typing.get_origin(kind) is list


def _quoted(text: str) -> bool:
    return len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""


def _yaml_value(kind: Any, text: str) -> str:
    """The YAML that OmegaConf reads back as ``text`` means: strings verbatim (``log_dir=`` is empty, not
    null; ``rollout.cuda_graphs=false`` the word), lists ``[a,b]`` as YAML or ``a,b`` split at commas."""
    if kind is str and not _quoted(text):
        return "'" + text.replace("'", "''") + "'"
    if _is_list(kind) and not text.startswith("["):
        return json.dumps([part for part in text.split(",") if part])
    return text


def parse_role(schema: type[Role], settings: Sequence[str], *, command: str) -> Role:
    """``key=value`` settings of ``asyncrl COMMAND`` -> a checked ``schema`` instance; ``ValueError``
    naming the key and the fix (an unknown key gets the nearest valid one, as ``asyncrl train`` does)."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    kinds = _leaf_types(schema)
    dotlist = []
    listed = f"`asyncrl {command} --help` lists every key."
    for item in settings:
        key, eq, value = item.partition("=")
        if not eq:
            raise ValueError(f"setting {item!r} is not key=value (e.g. controller=tcp://HOST:PORT); {listed}")
        check_known_keys(_nested(key), source=f"setting {item!r}", schema=schema, where=listed)
        if key not in kinds:
            raise ValueError(f"{key} is a section of settings, not one setting; set its keys, e.g. {key}.X=... {listed}")
        dotlist.append(f"{key}={_yaml_value(kinds[key], value)}")
    try:
        merged = OmegaConf.merge(structured(schema), OmegaConf.from_dotlist(dotlist))
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as e:
        wrong = type_error(e, settings, schema, WORKER_RANGES if schema is WorkerRoleConfig else {})
        raise ValueError(wrong or f"bad configuration: {e}".replace("\n", " ")) from None
    assert isinstance(cfg, schema)
    if isinstance(cfg, WorkerRoleConfig):
        check_worker_role(cfg)
    elif isinstance(cfg, LearnerRoleConfig) and not cfg.controller:
        raise ValueError("controller=tcp://HOST:PORT is required (printed by `asyncrl controller`)")
    return cfg


def _nested(dotted: str) -> dict[str, Any]:
    head, _, rest = dotted.partition(".")
    return {head: _nested(rest) if rest else None}


def check_worker_role(cfg: WorkerRoleConfig) -> WorkerRoleConfig:
    """The checks a worker's settings pass before it opens a socket (ranges, choices, devices)."""
    if not cfg.controller:
        raise ValueError("controller=tcp://HOST:PORT is required (printed by `asyncrl train` at start)")
    check_ranges(cfg, WORKER_RANGES)
    require_choice("rollout.engine", cfg.rollout.engine, ENGINES)
    parse_device(cfg.rollout.device, key="rollout.device")
    parse_device(cfg.sglang.device, key="sglang.device", indexed=False)
    check_decode_options(cfg.rollout)
    cfg.log_level = cfg.log_level.upper()
    require_choice("log_level", cfg.log_level, LOG_LEVELS)
    if cfg.quant.fmt:
        require_choice("quant.fmt", cfg.quant.fmt, QUANT_FORMATS)
    check_serving(cfg.rollout.engine, cfg.quant.fmt or "fp32")
    return cfg


def worker_formats(engine: str, fmt: str, run_fmt: str) -> tuple[str, str]:
    """The one place a worker's (actor format, fetched format) are decided, by the controller at its Hello (the
    Welcome states both): a native actor runs and fetches its own ``quant.fmt`` or the run's; an SGLang one serves
    its own, else the run's if SGLang serves it, else fp32, and fetches full precision (fp8 quantizes bf16)."""
    if engine != "sglang":
        return fmt or run_fmt, fmt or run_fmt
    actor = fmt or (run_fmt if run_fmt in SGLANG_SERVING else "fp32")
    return actor, sglang_wire_format(actor)


def server_settings(cfg: WorkerSGLangConfig) -> SGLangConfig:
    """The ``SGLangConfig`` part of a worker's ``sglang`` section (``model_path`` is the engine's own)."""
    return SGLangConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(SGLangConfig)})


def worker_role_for_run(cfg: TrainConfig, *, controller: str, worker_id: str, log_dir: str) -> WorkerRoleConfig:
    """The settings of a worker a launcher starts for run ``cfg``: its engine, device, decode options,
    transport keys and every ``sglang.*`` setting (its formats are the controller's, ``worker_formats``)."""
    r = cfg.rollout
    return WorkerRoleConfig(
        controller=controller, worker_id=worker_id, log_dir=log_dir,
        transport=RoleTransportConfig(keys_dir=cfg.transport.keys_dir),
        rollout=RoleRolloutConfig(engine=r.engine, device=r.device, decode_step=r.decode_step,
                                  cuda_graphs=r.cuda_graphs, compile=r.compile, prewarm=r.prewarm,
                                  overlap=r.overlap),
        sglang=WorkerSGLangConfig(**dataclasses.asdict(cfg.sglang)))


def _text(kind: Any, value: Any) -> str:
    """``value`` as the text after ``key=`` that ``parse_role`` reads back as ``value`` (a literal ``${`` is
    escaped, as OmegaConf would otherwise resolve it as an interpolation)."""
    if isinstance(value, bool):
        return str(value).lower()
    if _is_list(kind):
        value = [v.replace("${", "\\${") for v in value]
        plain = bool(value) and all(v and not _quoted(v) and not set(v) & set(",[]'\"") for v in value)
        return ",".join(value) if plain else json.dumps(value)
    if isinstance(value, str):
        value = value.replace("${", "\\${")
        return json.dumps(value) if _quoted(value) else value
    return str(value)


def role_dotlist(cfg: Any) -> list[str]:
    """Every leaf of the role config ``cfg`` as ``key=value``, in schema order (``parse_role``'s inverse)."""
    out = []
    for key, kind in _leaf_types(type(cfg)).items():
        node = cfg
        for part in key.split("."):
            node = getattr(node, part)
        out.append(f"{key}={_text(kind, node)}")
    return out


def _field_docs(schema: type) -> dict[str, str]:
    """Field name -> the docstring under it, over ``schema`` and its dataclass bases."""
    docs: dict[str, str] = {}
    for cls in reversed(schema.__mro__):
        if not dataclasses.is_dataclass(cls):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
        assert isinstance(body, ast.ClassDef)
        for stmt, nxt in zip(body.body, body.body[1:], strict=False):
            if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
                docs[stmt.target.id] = " ".join(nxt.value.value.split())
    return docs


def _form_and_meaning(doc: str, kind: Any) -> tuple[str, str]:
    """``"``A|B``: meaning. More."`` -> ``("A|B", "meaning")``; without a leading form, one from the type."""
    form = {bool: "true|false", int: "N", float: "X"}.get(kind, "[A,B]" if _is_list(kind) else "TEXT")
    if doc.startswith("``") and "``" in doc[2:]:
        form, _, doc = doc[2:].partition("``")
        doc = doc.lstrip(":, ")
    first = re.split(r"(?<=[a-z)\]])\. (?=[A-Z])", doc)[0].rstrip(".").replace("``", "")
    return form, first


def settings_help(schema: type, prefix: str = "") -> list[str]:
    """One line per key of ``schema``: ``key=FORM   meaning`` (the first sentence of its docstring)."""
    lines = []
    hints = typing.get_type_hints(schema)
    docs = _field_docs(schema)
    for f in dataclasses.fields(schema):
        kind = hints[f.name]
        if isinstance(kind, type) and dataclasses.is_dataclass(kind):
            lines += settings_help(kind, f"{prefix}{f.name}.")
            continue
        form, meaning = _form_and_meaning(docs.get(f.name, ""), kind)
        lines.append(f"  {f'{prefix}{f.name}={form}':<34} {meaning}")
    return lines


def role_keys(schema: type) -> list[str]:
    """Every dotted leaf key of a role schema (what its ``--help`` lists)."""
    return [k for k, v in schema_keys(schema).items() if v is None]
