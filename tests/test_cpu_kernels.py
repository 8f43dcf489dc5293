"""The float32 block kernels (server/model/cpu_kernels.py): built on the host, reused, refused safely.

What quantized.py relies on is tested in tests/test_quantized.py over both kernels (error bounds, a row's
result in any batch, greedy text across proposers); here: the build itself, the AVX2 variant on a host that
has AVX-512, and what happens without a compiler.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import pytest
import torch

from server.model import cpu_kernels, kernel_build
from server.model.quantized import Q4Linear, Q8Linear, unpack_nibbles
from tests.kernel_marks import buildable_here, needs_kernels

build = cpu_kernels.library.__wrapped__  # the uncached builder: each call builds or finds a library anew


def _cpu_flags() -> set[str]:
    try:
        line = next(x for x in Path("/proc/cpuinfo").read_text().splitlines() if x.startswith("flags"))
    except (OSError, StopIteration):
        return set()
    return set(line.split(":", 1)[1].split())


def test_the_kernels_load_where_they_can_be_built():
    """On x86-64 with a compiler the kernels are there: a source that stops compiling, or a probe product that
    differs, fails here with the reason instead of turning every kernel test into a skip."""
    if not buildable_here():
        pytest.skip("no C compiler or x86-64 CPU here")
    assert cpu_kernels.library() is not None, f"the CPU block kernels did not load: {cpu_kernels.problem()}"
    assert cpu_kernels.build_id() and cpu_kernels.problem() is None


@pytest.mark.slow
@needs_kernels
def test_a_library_is_built_once_per_source_compiler_and_cpu_and_then_reused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path))
    assert build() is not None
    built = list(tmp_path.glob("kernels-*.so"))
    assert len(built) == 1 and not [p for p in tmp_path.iterdir() if p.is_dir()]  # no temporaries left
    stamp = built[0].stat().st_mtime_ns
    assert build() is not None
    assert list(tmp_path.glob("kernels-*.so")) == built and built[0].stat().st_mtime_ns == stamp
    identity = kernel_build.cpu_identity()
    monkeypatch.setattr(kernel_build, "cpu_identity", lambda: identity.replace("model name", "model name: another"))
    assert build() is not None
    assert len(list(tmp_path.glob("kernels-*.so"))) == 2  # never loads a library built for other flags


def test_without_a_compiler_quantized_layers_keep_torchs_kernel(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert build() is None
    assert "unavailable" in caplog.text
    monkeypatch.setattr(cpu_kernels, "library", build)
    layer = Q4Linear.quantize(torch.randn(32, 64))
    assert layer.runs_kernel() == hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
    assert layer.rounds_inputs() == layer.runs_kernel()  # torch's kernel: bf16 inputs, float64 attention


def test_the_kernels_can_be_switched_off(monkeypatch):
    monkeypatch.setenv("SPECULA_CPU_KERNELS", "0")
    assert build() is None


@pytest.mark.slow
@needs_kernels
@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="an AVX2 CPU builds the AVX2 variant")
def test_the_avx2_variant_gives_the_same_results_within_float32_and_rows_in_any_batch(tmp_path, monkeypatch):
    """Most laptops have AVX2 and no AVX-512: the kernels' other branch, built here for a Haswell."""
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path))
    lib = build("avx2")
    assert lib is not None
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 96, generator=g)
    q4 = Q4Linear.quantize(torch.randn(40, 96, generator=g) * 0.05)
    s, z = q4.scales_zeros[..., 0].t(), q4.scales_zeros[..., 1].t()
    q8 = Q8Linear.quantize(torch.randn(40, 96, generator=g) * 0.05)
    cases = [(cpu_kernels.Tiles.q4(unpack_nibbles(q4.qweight), s, z - 8 * s, lib, int8=i8), q4, i8)
             for i8 in (False, True)] + [(cpu_kernels.Tiles.q8(q8.qweight, q8.scales, lib, int8=i8), q8, i8)
                                         for i8 in (False, True)]
    for tiles, layer, rounded in cases:  # rounded: int8 activations, half a step of each input's group
        got = tiles(x)
        exact = x.double() @ layer.dequantize().double().t()
        slack = cpu_kernels.activation_error(x) @ layer.scaled_values().double().t() if rounded else 0
        assert ((got.double() - exact).abs() <= slack + 1e-5 * exact.abs().max()).all()
        assert all(torch.equal(tiles(x[i : i + 1])[0], got[i]) for i in range(7))


@needs_kernels
@pytest.mark.skipif("avx2" not in _cpu_flags(), reason="an AVX2 CPU builds the AVX2 variant")
def test_the_avx2_variants_decoder_agrees_with_the_torch_path_and_keeps_a_positions_bits(tmp_path, monkeypatch):
    """The whole-stack call (cpu_decoder.py) of the AVX2 build: the lean forward's function (on float32
    activations: the paths differ only in the order of float sums), and a position's logits the same bits fed alone
    or within a pass."""
    from server.model.attention import use_gqa_attention
    from server.model.lean_forward import LeanForward
    from server.model.quantize import quantize_linears
    from server.model.runner import ModelRunner
    from tests.models import tiny_llama

    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("SPECULA_INT8_ACTIVATIONS", "0")
    lib = build("avx2")
    assert lib is not None
    monkeypatch.setattr(cpu_kernels, "library", lambda: lib)
    model = tiny_llama(512, seed=5)
    quantize_linears(model, "q4")
    use_gqa_attention(model)
    prompt, tail = [(7 * i) % 500 + 3 for i in range(30)], [11, 12, 13, 14, 15]
    fast = ModelRunner(model)
    assert fast.call.decoder is not None and fast.call.decoder.lib is lib
    slow = ModelRunner(model)
    slow.call = LeanForward(model, model.model)
    slow.call.decoder = None
    for runner in (fast, slow):
        runner.join(["a"], [prompt])
    a, b = fast.forward([tail]).logits, slow.forward([tail]).logits
    assert torch.allclose(a, b, rtol=0, atol=2e-5 * float(b.abs().max()))
    single = ModelRunner(model)
    single.join(["a"], [prompt])
    one = torch.cat([single.forward([[t]]).logits[0] for t in tail])
    assert torch.equal(one, a[0])


@needs_kernels
def test_kernels_are_built_under_the_servers_cache_dir(tmp_path, monkeypatch):
    """A server whose `cache_dir` is a volume keeps its built kernels there (the environment variable wins)."""
    from server.model.loading import load_model
    from tests.models import write_tiny_gguf

    monkeypatch.delenv("SPECULA_KERNEL_DIR", raising=False)
    monkeypatch.setattr(cpu_kernels, "_directory", None)
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hidden=64, quant="Q4_1")
    load_model(str(path), device="cpu", cache_dir=tmp_path / "cache", weights="as-file")
    assert cpu_kernels._directory == tmp_path / "cache" / "kernels"
    assert build() is not None
    assert list((tmp_path / "cache" / "kernels").glob("kernels-*.so"))
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path / "elsewhere"))
    assert build() is not None and list((tmp_path / "elsewhere").glob("kernels-*.so"))


# ---- a damaged kernel cache costs a rebuild, never a crash ----------------------------------------------------


def _damage(library: Path, how: str) -> None:
    data = library.read_bytes()
    if how == "truncated":  # a full disk, an interrupted copy of the cache volume
        library.write_bytes(data[: len(data) // 2])
    elif how == "overwritten":  # the same size, other bytes
        library.write_bytes(os.urandom(len(data)))
    elif how == "empty":
        library.write_bytes(b"")
    else:  # unreadable: a link to nowhere (root reads any file, whatever its mode)
        library.unlink()
        library.symlink_to(library.with_name("gone.so"))


_START = """
import sys
from server.model import cpu_kernels
from server.model.quantized import Q4Linear
import torch
lib = cpu_kernels.library()
layer = Q4Linear.quantize(torch.randn(48, 64, generator=torch.Generator().manual_seed(3)))
y = layer(torch.ones(2, 64))
print(lib is not None, layer.runs_kernel(), cpu_kernels.build_id(), float(y.double().sum()))
"""


def _start(directory: Path) -> list[str]:
    """A fresh process's kernels under `directory` (a damaged library loaded in-process would crash pytest)."""
    import subprocess
    import sys

    env = {**os.environ, "SPECULA_KERNEL_DIR": str(directory)}
    done = subprocess.run([sys.executable, "-c", _START], capture_output=True, text=True, env=env, timeout=300,
                          cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr[-2000:]  # SIGBUS / SIGSEGV before the digest check
    return done.stdout.split()


@pytest.mark.slow
@needs_kernels
@pytest.mark.parametrize("how", ["truncated", "overwritten", "empty", "unreadable"])
def test_a_damaged_library_is_rebuilt_and_the_start_serves_the_same_blocks(tmp_path, how):
    healthy = _start(tmp_path)
    assert healthy[:2] == ["True", "True"]
    (library,) = tmp_path.glob("kernels-*.so")
    _damage(library, how)
    again = _start(tmp_path)
    assert again == healthy  # the blocks on the same kernels, the same products
    rebuilt = [p for p in tmp_path.glob("kernels-*.so") if p.is_file() and not p.is_symlink()]
    assert len(rebuilt) == 1 and kernel_build._digest(rebuilt[0]) == rebuilt[0].stem.rsplit("-", 1)[1]
    assert _start(tmp_path) == healthy  # and the next start loads the rebuilt file


@needs_kernels
def test_an_unwritable_kernel_directory_builds_privately_instead_of_giving_up_the_blocks(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(blocked / "kernels"))
    lib = build()
    assert lib is not None and cpu_kernels.problem() is None
    assert blocked.read_text() == "not a directory"


def test_a_build_that_fails_is_reported_for_health(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECULA_KERNEL_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setattr(cpu_kernels, "_problems", {})
    assert build() is None
    if cpu_kernels.host_isa() is not None and os.uname().machine in ("x86_64", "amd64"):
        assert "no C compiler" in cpu_kernels.problem()
    monkeypatch.setenv("SPECULA_CPU_KERNELS", "0")
    monkeypatch.setattr(cpu_kernels, "_problems", {})
    assert build() is None and cpu_kernels.problem() is None  # switched off on purpose: nothing degraded


def test_the_kinds_and_structs_have_one_definition():
    """csrc/specula.h is the only copy of the block kinds; cpu_decoder.py's ctypes mirrors match its structs."""
    from server.model import cpu_decoder

    header = (cpu_kernels.CSRC / "specula.h").read_text()
    assert f"KIND_Q4_INT8 = {cpu_kernels.KIND_Q4_INT8}," in header and "KIND_F16 = 16" in header
    lib = cpu_kernels.library()
    if lib is None:
        pytest.skip("no kernels here")
    assert cpu_kernels.abi(lib) == tuple(ctypes.sizeof(struct) for struct in cpu_decoder.SIZES)
