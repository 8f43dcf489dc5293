"""The converted-weights cache (server/model/loading.py) never serves garbage and never wedges a start:
an unwritable directory, a truncated or corrupted file, and replicas racing on one empty directory all
end in a served model with the GGUF's weights; a load that cannot succeed makes `serve` exit non-zero.
Every fault is made for real on a tiny GGUF file (tests/models.py), in both kinds of entry: the file's own
tensors (`as-file`, the default on CPU) and the dequantized fp32 weights (what the other formats start from)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import torch
from fastapi.testclient import TestClient

from server.api.app import create_app
from server.config import Settings
from server.model import weights_cache
from server.model.loading import load_model
from tests.models import write_tiny_gguf
from tests.test_api_serve import free_port


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-model.gguf")


# weights format -> (its entry's weights file, what a conversion logs)
FORMATS = {"as-file": ("quantized.safetensors", "reading the quantized tensors"),
           "fp32": ("model.safetensors", "dequantizing")}


@pytest.fixture(scope="module", params=list(FORMATS))
def fmt(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def reference(gguf_file, fmt) -> dict[str, torch.Tensor]:
    """The GGUF's weights in the format, converted without any cache."""
    model = load_model(str(gguf_file), device="cpu", cache_dir=None, weights=fmt).model
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.fixture
def load(fmt):
    return lambda gguf, cache_dir: load_model(str(gguf), device="cpu", cache_dir=cache_dir, weights=fmt)


@pytest.fixture
def entry(fmt):
    return lambda gguf, cache_dir: weights_cache.entry_path(gguf, cache_dir, fmt)


@pytest.fixture
def weights_file(fmt) -> str:
    return FORMATS[fmt][0]


@pytest.fixture
def dequantized(fmt):
    """How many loads logged converting the GGUF (a cache miss) since the last `caplog.clear()`."""
    return lambda caplog: sum(FORMATS[fmt][1] in r.getMessage() for r in caplog.records)


def assert_weights(model, reference: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == reference.keys()
    bad = [k for k, v in reference.items() if not torch.equal(state[k], v)]
    assert not bad, f"weights differ from the GGUF's: {bad[:5]}"


@pytest.fixture(autouse=True)
def _logs(caplog):
    caplog.set_level(logging.INFO, logger="server.model.loading")


def test_a_warm_cache_is_read_not_converted_again(gguf_file, reference, tmp_path, caplog, load, entry, dequantized,
                                                   weights_file):
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 1 and (entry(gguf_file, tmp_path) / weights_file).is_file()
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [entry(gguf_file, tmp_path).name]  # no leftovers


def writable(directory: Path) -> bool:
    try:
        (directory / "probe").touch()
    except PermissionError:
        return False
    (directory / "probe").unlink()
    return True


@contextmanager
def read_only(directory: Path) -> Iterator[Path]:
    """`directory` made read-only for real: chmod 0o555, and as root (whom modes do not stop) the
    immutable attribute (`chattr +i`, which stops root too) where the file system has it; else a skip."""
    directory.mkdir(exist_ok=True)
    directory.chmod(0o555)
    immutable = False
    try:
        if writable(directory) and shutil.which("chattr"):
            immutable = subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0
        if writable(directory):
            pytest.skip("running as root without `chattr +i` here: nothing makes a directory read-only for root")
        yield directory
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def file_in_the_way(tmp_path: Path) -> Path:
    """A regular file where the cache directory's parent should be: mkdir fails (for root too)."""
    (tmp_path / "volume").write_text("not a directory")
    return tmp_path / "volume" / "cache"


@pytest.mark.parametrize("fault", ["read-only", "file-in-the-way"])
def test_an_unwritable_cache_serves_from_memory(fault, gguf_file, reference, tmp_path, caplog, load):
    with ExitStack() as stack:
        if fault == "read-only":
            cache = stack.enter_context(read_only(tmp_path / "cache"))
        else:
            cache = file_in_the_way(tmp_path)
        loaded = load(gguf_file, cache)
        assert not cache.is_dir() or list(cache.iterdir()) == []  # nothing written, nothing half-written
    assert_weights(loaded.model, reference)
    assert any(r.levelno == logging.WARNING and "serving from memory" in r.getMessage() for r in caplog.records)


def test_a_damaged_entry_in_a_read_only_directory_serves_from_memory(gguf_file, reference, tmp_path, caplog, load,
                                                                     entry, weights_file):
    cache = tmp_path / "cache"
    load(gguf_file, cache)
    weights = entry(gguf_file, cache) / weights_file
    size = weights.stat().st_size
    os.truncate(weights, size // 2)
    caplog.clear()
    with read_only(cache):
        assert_weights(load(gguf_file, cache).model, reference)
    assert any("serving from memory" in r.getMessage() for r in caplog.records)
    assert weights.stat().st_size == size // 2  # left as it was: the directory could not be written


def test_an_entry_without_its_manifest_is_converted_again(gguf_file, reference, tmp_path, caplog, load, entry,
                                                          dequantized):
    """A write killed before its manifest, or a cache from a version before checked entries."""
    load(gguf_file, tmp_path)
    (entry(gguf_file, tmp_path) / weights_cache.MANIFEST).unlink()
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 1 and (entry(gguf_file, tmp_path) / weights_cache.MANIFEST).is_file()


def test_a_truncated_file_is_converted_again_and_replaced(gguf_file, reference, tmp_path, caplog, load, entry,
                                                          dequantized, weights_file):
    load(gguf_file, tmp_path)
    weights = entry(gguf_file, tmp_path) / weights_file
    size = weights.stat().st_size
    os.truncate(weights, size // 2)  # a full disk, a killed copy
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 1
    assert weights.stat().st_size == size  # the bad file was replaced ...
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 0  # ... so the next start reads it again


def test_a_flipped_byte_is_caught_and_the_file_replaced(gguf_file, reference, tmp_path, caplog, load, entry,
                                                        dequantized, weights_file):
    load(gguf_file, tmp_path)
    weights = entry(gguf_file, tmp_path) / weights_file
    data = bytearray(weights.read_bytes())
    data[len(data) * 3 // 4] ^= 0xFF  # inside a tensor: the file still parses, same size, wrong weights
    weights.write_bytes(bytes(data))
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 1
    assert any("rebuilding" in r.getMessage() for r in caplog.records)
    caplog.clear()
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert dequantized(caplog) == 0


REPLICA = """
import logging, pathlib, sys, time
import torch
from transformers import PreTrainedModel

gguf, cache, ready, name, out, fmt = sys.argv[1:]
from server.model import weights_cache
real_manifest = weights_cache._write_manifest

def manifest(*args, **kwargs):  # both replicas write at once: each waits here until the other is here too
    pathlib.Path(ready, name).touch()
    deadline = time.monotonic() + 60
    while len(list(pathlib.Path(ready).iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    return real_manifest(*args, **kwargs)

weights_cache._write_manifest = manifest
logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
from server.model.loading import load_model

torch.save(load_model(gguf, device="cpu", cache_dir=pathlib.Path(cache), weights=fmt).model.state_dict(), out)
"""


@pytest.mark.slow
def test_two_replicas_racing_on_an_empty_cache_both_load(gguf_file, reference, tmp_path, caplog, fmt, load, entry,
                                                         dequantized):
    """Two replicas (processes) on one empty shared volume: both convert the GGUF and write the cache at
    the same moment; one entry wins, the other replica loads the winner's; no temporaries are left."""
    cache, ready = tmp_path / "cache", tmp_path / "ready"
    ready.mkdir()
    root = Path(__file__).resolve().parents[1]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", REPLICA, str(gguf_file), str(cache), str(ready), str(i), str(tmp_path / f"{i}.pt"),
             fmt],
            cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    for i in range(2):
        state = torch.load(tmp_path / f"{i}.pt")
        assert state.keys() == reference.keys() and all(torch.equal(state[k], v) for k, v in reference.items())
    assert sum("another process cached" in out for out in outs) == 1, outs
    assert sorted(p.name for p in cache.iterdir()) == [entry(gguf_file, cache).name]  # no temporaries left
    caplog.clear()
    assert_weights(load(gguf_file, cache).model, reference)
    assert dequantized(caplog) == 0


def test_temporaries_of_writers_that_died_are_swept(gguf_file, reference, tmp_path, load, entry):
    """A replica killed mid-write leaves `<entry>.tmp-<pid>-<random>` (540 MB for SmolLM2): the next
    write removes those an hour old, never a live writer's."""
    name = entry(gguf_file, tmp_path).name
    dead, live = tmp_path / f"{name}.tmp-999999-dead", tmp_path / f"{name}.tmp-999998-live"
    for d in (dead, live):
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"half")
    hours_ago = time.time() - 2 * weights_cache.STALE_TEMPORARY_S
    os.utime(dead, (hours_ago, hours_ago))
    assert_weights(load(gguf_file, tmp_path).model, reference)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([name, live.name])


def test_a_failed_load_reports_503_and_asks_to_exit(tmp_path):
    """`ServerState` tells its runner (serve.py) that loading failed, and /health keeps answering 503
    (the reason in the log, not in the body) while the runner shuts down."""

    def broken_factory(settings):
        raise OSError("the target cannot be read")

    app = create_app(Settings.load(cache_dir=tmp_path), broken_factory)
    state = app.state.specula
    failed = threading.Event()
    state.on_failed = failed.set
    with TestClient(app) as client:
        assert failed.wait(30)
        health = client.get("/health")
        assert health.status_code == 503 and health.json()["status"] == "failed"
        assert "the target cannot be read" not in health.json()["error"]  # internals stay in the log


@pytest.mark.slow
def test_serve_exits_non_zero_when_the_model_cannot_load(tmp_path):
    """The real process with a target that is no GGUF: it logs why and exits 1 for its supervisor, instead
    of answering 503 forever."""
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    port = free_port()
    cmd = [sys.executable, "-m", "server", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--target", str(bad), "--speculation", "none"]
    env = {**os.environ, "SPECULA_CACHE_DIR": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    statuses: set[int] = set()
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "the server is still running after its load failed"
            try:
                statuses.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code)
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        out = proc.communicate(timeout=30)[0]
        assert proc.returncode == 1, out[-3000:]
        assert statuses <= {503}, statuses  # never healthy on the way out
        assert "model loading failed" in out and str(bad) in out, out[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
