"""Building the CPU kernels (cpu_kernels.py loads and calls them): csrc/kernels.c compiled once per instruction set
and host, cached, and never loaded damaged.

Built with the host's C compiler (`CC`, default `cc`; `FLAGS` plus the instruction set's) into `kernels/` under the
server's `cache_dir` (`~/.cache/specula/kernels/` by default; `SPECULA_KERNEL_DIR` wins) as
`kernels-<isa>-<key>-<digest>.so`: the key hashes the sources, the compiler, the flags and this CPU's model and
flags (a library built for another CPU is never loaded), the digest the library's own bytes. A library is loaded
only when its bytes match the digest its name gives: a truncated, overwritten, empty or unreadable file (a full
disk, an interrupted copy of the cache volume) would crash the process when loaded (SIGBUS, SIGSEGV), so it is
removed and built again (in a temporary directory, renamed into place: atomic). A directory that cannot be written
builds into a private temporary directory instead (every start builds again; about 2 s). OpenMP resolves to the
libgomp torch already loaded, so both share one thread pool; a call uses torch's current thread count.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")  # the C sources: specula.h (kinds, structs), kernels.c, one header per ISA
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC", "-Wall", "-Wextra",
         "-Wno-psabi")
# the instruction sets kernels.c is built for, each with what it adds to FLAGS; the host's best one is loaded
ISA_FLAGS = {"avx512": ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"),
             "avx2": ("-mno-avx512f", "-mavx2", "-mfma", "-mf16c")}
_ISA_NEEDS = {"avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"}, "avx2": {"avx2", "fma", "f16c"}}


@functools.cache
def cpu_identity() -> str:
    """This CPU's model and feature flags (a library built with -march=native runs only where they match); read
    once: every quantized layer asks (`cpu_kernels.int8_activations`), and /proc/cpuinfo grows with the cores."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
        return "\n".join(wanted) or platform.processor()
    except OSError:
        return platform.processor()


def host_isa() -> str | None:
    """The best instruction set of `ISA_FLAGS` this CPU runs (None: neither, no kernels here)."""
    flags = set(next((line.split(":", 1)[1] for line in cpu_identity().splitlines() if line.startswith("flags")),
                     "").split())
    return next((isa for isa, needs in _ISA_NEEDS.items() if needs <= flags), None)


def _sources() -> list[Path]:
    return sorted(p for p in CSRC.iterdir() if p.suffix in (".c", ".h"))


def _key(compiler: str, isa: str) -> str:
    """What a library's bytes depend on: the sources, the compiler and its version, the flags, this CPU."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    parts = [p.read_text() for p in _sources()] + [compiler, version, *FLAGS, *ISA_FLAGS[isa], platform.machine(),
                                                   cpu_identity()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def _find(directory: Path, stem: str) -> Path | None:
    """A library `<stem>-<digest>.so` under `directory` whose bytes have the digest its name gives. Any other such
    file (truncated, overwritten, unreadable: a full disk, an interrupted copy of the cache) is removed where it
    can be and never loaded: loading damaged bytes crashes the process (SIGBUS, SIGSEGV)."""
    for path in sorted(directory.glob(f"{stem}-*.so")):
        try:
            if _digest(path) == path.stem.rsplit("-", 1)[1]:
                return path
        except OSError as err:
            log.warning("the kernel library %s is unreadable (%s): building it again", path, err)
            continue
        log.warning("the kernel library %s does not match its digest (damaged): building it again", path)
        with contextlib.suppress(OSError):
            path.unlink()
    return None


def _compiler_run(compiler: str, isa: str, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """csrc/kernels.c compiled for `isa` into `out` (FLAGS, the instruction set's, then `extra`)."""
    return subprocess.run([compiler, *FLAGS, *ISA_FLAGS[isa], *extra, f"-I{CSRC}", "-o", str(out),
                           str(CSRC / "kernels.c")], capture_output=True, text=True, timeout=300)


def _compile_into(compiler: str, isa: str, work: Path, directory: Path, stem: str) -> Path:
    """The library built in `work`, renamed into `directory` as `<stem>-<digest>.so` (atomic)."""
    built = work / "kernels.so"
    done = _compiler_run(compiler, isa, built)
    if done.returncode != 0:
        raise RuntimeError(f"compiling the kernels ({isa}) failed: {done.stderr.strip()[-500:]}")
    target = directory / f"{stem}-{_digest(built)}.so"
    os.replace(built, target)
    return target


def build_library(directory: Path, isa: str) -> Path:
    """The library for `isa` under `directory`, found by its key and checked against its digest, or built there
    (in a temporary directory beside it, renamed into place: atomic, and a concurrent build renames the same bytes
    over it). A directory that cannot be written builds into a private temporary one instead (every start builds
    again, with a warning) rather than giving up the kernels."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise FileNotFoundError(f"no C compiler {compiler!r}")
    stem = f"kernels-{isa}-{_key(compiler, isa)}"
    if directory.is_dir() and (found := _find(directory, stem)) is not None:
        return found
    try:
        directory.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=directory, prefix=".build-"))
    except OSError as err:
        private = Path(tempfile.mkdtemp(prefix="specula-kernels-"))
        log.warning("the kernel directory %s cannot be written (%s): building into %s for this process only",
                    directory, err, private)
        return _compile_into(compiler, isa, private, private, stem)
    try:
        return _compile_into(compiler, isa, work, directory, stem)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def lint() -> list[str]:
    """Compile csrc/kernels.c for every instruction set with warnings as errors (`make lint`); the failures' output."""
    compiler = os.environ.get("CC", "cc")
    failures = []
    for isa in ISA_FLAGS:
        with tempfile.TemporaryDirectory() as work:
            done = _compiler_run(compiler, isa, Path(work) / "k.so", "-Werror")
        if done.returncode != 0:
            failures.append(f"{isa}: {done.stderr.strip()}")
    return failures
