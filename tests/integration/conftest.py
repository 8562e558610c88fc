"""Fixtures of the integration tests beyond the shared ones in ``tests/conftest.py``."""

from __future__ import annotations

import pytest

from tests.integration.fsdp_ranks import TORCHRUN_VARS


@pytest.fixture
def no_inherited_torchrun_env(monkeypatch):
    """The test process forgets any torchrun variable it inherited, so ranks started at world size 1
    (``fsdp_ranks.launch_ranks``) form their own one-process group."""
    for var in TORCHRUN_VARS:
        monkeypatch.delenv(var, raising=False)
