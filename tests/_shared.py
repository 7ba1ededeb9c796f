"""Access to ../shared/data (real traces, reference results) for tests marked ``shared``.

The shared data exists on the project's machines and in CI but not on a user's checkout, so tests
that need it skip there with a reason. CI sets GREENSWARM_REQUIRE_SHARED=1 so that a missing or
moved file fails loudly instead of silently skipping the very tests that check real data.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

SHARED_DATA = Path(__file__).parents[1] / "../shared/data"


def _require() -> bool:
    return os.environ.get("GREENSWARM_REQUIRE_SHARED") == "1"


def shared_available() -> bool:
    """Whether ../shared/data is here (fails the test when it is required and missing)."""
    if SHARED_DATA.resolve().is_dir():
        return True
    if _require():
        pytest.fail(f"shared data not found at {SHARED_DATA.resolve()} (GREENSWARM_REQUIRE_SHARED=1)")
    return False


def shared_path(rel: str) -> Path:
    """Path of ``rel`` under ../shared/data; skips the test if that folder is absent (fails if required).

    A missing file inside a present folder always fails: that is a renamed or lost file, not an
    environment without the data.
    """
    base = SHARED_DATA.resolve()
    if not base.is_dir():
        message = f"shared data not found at {base}"
        if _require():
            pytest.fail(f"{message} (GREENSWARM_REQUIRE_SHARED=1)")
        pytest.skip(f"{message}; these tests run on the project's machines and in CI")
    path = base / rel
    if not path.exists():
        pytest.fail(f"{path} is missing from the shared data")
    return path
