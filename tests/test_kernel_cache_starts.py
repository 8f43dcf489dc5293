"""Every start after any damage to the cached kernels becomes a healthy engine with the same greedy text and the same
weights form (issue 69): a real `build_engine` in a fresh process per start (a damaged library loaded in-process
would crash pytest), on a tiny GGUF served as its file's blocks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernel_marks import needs_kernels
from tests.test_cpu_kernels import _damage

pytestmark = [pytest.mark.slow, needs_kernels]

_START = """
import json, sys
from server.config import Settings
from server.engine.engine import build_engine
from tests.engine_helpers import request, run
settings = Settings.load(target=sys.argv[1], cache_dir=sys.argv[2], calibrate=False, draft_head=None)
engine = build_engine(settings)
tokens = run(engine, [request("r", [5, 17, 40, 99, 120, 3, 77, 8], "ngram", 4, max_tokens=12)])["r"]
print(json.dumps({"weights": engine.weights, "tokens": tokens, "degraded": sorted(engine.parts.report())}))
"""


def _start(model: Path, cache: Path, **env: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _START, str(model), str(cache)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parents[1], env={**os.environ, **env})
    assert done.returncode == 0, done.stderr[-3000:]  # SIGBUS / SIGSEGV would show here
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    from tests.models import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf", hidden=64, quant="Q4_1")


def test_every_damage_to_the_kernel_cache_costs_a_rebuild_not_a_start(model, tmp_path):
    cache = tmp_path / "cache"
    healthy = _start(model, cache)
    assert healthy["weights"] == "as-file" and "kernels" not in healthy["degraded"] and len(healthy["tokens"]) == 12
    for how in ("truncated", "overwritten", "empty", "unreadable"):
        (library,) = [p for p in (cache / "kernels").glob("kernels-*.so") if p.is_file() and not p.is_symlink()]
        _damage(library, how)
        assert _start(model, cache) == healthy, how


def test_an_unwritable_cache_directory_still_serves_the_files_blocks(model, tmp_path):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")  # as root a read-only mode stops nothing: a path under a file does
    healthy = _start(model, tmp_path / "cache")
    assert _start(model, blocked / "cache") == healthy


def test_a_build_that_cannot_happen_is_listed_as_degraded(model, tmp_path):
    """No compiler: the blocks on torch's kernel, `kernels` under /health's degraded (the engine's parts report)."""
    started = _start(model, tmp_path / "cache", CC=str(tmp_path / "no-such-cc"))
    assert "kernels" in started["degraded"] and len(started["tokens"]) == 12
