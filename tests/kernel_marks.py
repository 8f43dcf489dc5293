"""Whether the CPU block kernels should be here, for the tests that need them.

A host that can build them (x86-64, a C compiler, the kernels not switched off) must have them: there the tests
that need them run and fail, rather than skip, when the build or its probe breaks. A kernel change that stopped
compiling once showed up as "24 skipped" and a green run; `test_the_kernels_load_where_they_can_be_built` now says
why instead."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from server.model import cpu_kernels


def buildable_here() -> bool:
    """x86-64 with an instruction set the kernels have, then CI (which installs the compiler and must not skip
    them), or a compiler here and SPECULA_CPU_KERNELS not off."""
    if platform.machine().lower() not in ("x86_64", "amd64") or cpu_kernels.host_isa() is None:
        return False
    if os.environ.get("CI"):
        return True
    if os.environ.get("SPECULA_CPU_KERNELS", "1").lower() in ("0", "false", "no", "off"):
        return False
    return shutil.which(os.environ.get("CC", "cc")) is not None


needs_kernels = pytest.mark.skipif(cpu_kernels.library() is None and not buildable_here(),
                                   reason="no C compiler or x86-64 CPU here: the CPU block kernels cannot build")
