import importlib.util
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
FIXTURES = Path(__file__).parent / "fixtures"

# The interface tests need the serve extra. `make test` installs it; the GPU machine, which runs `pytest -m gpu`
# with only the core wheels, would otherwise fail to collect them (none of them is a GPU test).
_SERVE = ("fastapi", "uvicorn", "sse_starlette", "openai", "httpx")
_EXTRAS = {"test_server.py": _SERVE, "test_kobold.py": _SERVE, "test_sampler_overrides.py": _SERVE + ("yaml",),
           "test_chat.py": ("fastapi", "sse_starlette"), "test_mcp.py": ("fastmcp",),
           "test_constraints.py": ("llguidance",)}
collect_ignore = [f for f, mods in _EXTRAS.items() if any(importlib.util.find_spec(m) is None for m in mods)]


@pytest.fixture(scope="session")
def fixtures() -> Path:
    return FIXTURES
