"""has_fast_bf16 agrees with the CPU's own flags (Linux, x86, no GPU)."""

import platform
from pathlib import Path

import pytest
import torch

from prefixgym.engine.device import has_fast_bf16


@pytest.mark.skipif(
    torch.cuda.is_available() or platform.machine() != "x86_64"
    or not Path("/proc/cpuinfo").exists(),
    reason="reads x86 CPU flags from /proc/cpuinfo",
)
def test_bf16_is_fast_exactly_where_the_cpu_has_bf16_instructions():
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags |= set(line.split(":", 1)[1].split())
    assert has_fast_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"})
