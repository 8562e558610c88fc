"""The command line of a role that joins a running job (``asyncrl worker``, ``asyncrl learner``).

Owns: ``role_argv``, the one ``argparse`` front of a role's ``key=value`` settings: it answers ``--help``
from the role's schema (one line per key, from the field docstrings) and hands the settings on, unparsed,
to ``asyncrl.config.roles.parse_role``.
Never: reads a setting itself, imports torch or zmq, or imports another ``workers`` module (the roles
and the top-level CLI both import it).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def role_argv(argv: Sequence[str], *, command: str, description: str, schema: type, note: str = "",
              usage_text: str = "") -> list[str]:
    """The ``key=value`` settings of ``asyncrl COMMAND`` (``--help``: the description, ``usage_text``,
    one line per key of ``schema`` from its docstrings, then ``note``; exits 0)."""
    from asyncrl.config.roles import settings_help  # no torch, no zmq: the schema and its docstrings

    epilog = "\n".join(filter(None, [usage_text, "settings (key=value):", *settings_help(schema), note]))
    p = argparse.ArgumentParser(prog=f"asyncrl {command}", description=description, epilog=epilog,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("settings", nargs="*", help="key=value settings (below)")
    return list(p.parse_args(list(argv)).settings)
