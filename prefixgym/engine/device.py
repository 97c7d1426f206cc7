"""Which device the engine runs on, and what it computes fast there: the facts the
engine's device and dtype choices rest on.

`resolve_device("auto")` picks the device (a GPU when torch sees one);
`has_fast_bf16(device)` says whether bf16 matmuls run natively. On an x86 CPU that is
AVX512-BF16 or AMX; without them oneDNN still "supports" bf16 by emulating it with
AVX512, and a training step then runs about 2.3x slower than in fp32 (tiny preset,
64 x 100 tokens: 15.1 s vs 6.5 s on an AVX512 Xeon without AVX512-BF16). Knows torch
and the CPU; nothing of models.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch

_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
DEVICE_VARIABLE = "PREFIXGYM_DEVICE"


def resolve_device(device: str | torch.device = "auto") -> torch.device:
    """"auto" -> $PREFIXGYM_DEVICE when set, else cuda when torch sees a GPU, else cpu
    (MPS only when asked for: not measured yet); anything else as torch names it."""
    if isinstance(device, str) and device == "auto":
        device = os.environ.get(DEVICE_VARIABLE) or ("cuda" if torch.cuda.is_available()
                                                      else "cpu")
    return torch.device(device)


def describe_device(device: torch.device) -> str:
    """One line: "cuda:0 (NVIDIA H200)" or "cpu (<describe_cpu()>)"."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    if device.type == "cpu":
        return f"cpu ({describe_cpu()})"
    return str(device)


def has_fast_bf16(device: torch.device | None = None) -> bool:
    """Whether bf16 matmuls run natively on `device` (default: the one "auto" picks): a
    CUDA GPU with bf16, an x86 CPU with AVX512-BF16 or AMX, or another CPU (ARM) for
    which oneDNN reports bf16."""
    device = device if device is not None else resolve_device()
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return False
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def describe_cpu() -> str:
    """One line: the CPU's model name and its bf16 instructions (what `compute_dtype auto`
    decides on), e.g. "Intel(R) Xeon(R) Processor, 2 cores, with avx512_bf16 amx_bf16"."""
    name, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.machine()):
                name = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags |= set(value.split())
    bf16 = [f for f in _BF16_FLAGS if f in flags]
    if not bf16 and platform.machine().lower() in ("x86_64", "amd64"):
        bf16_text = "without native bf16 (" + ("AVX-512" if "avx512f" in flags else "AVX2") + ")"
    elif bf16:
        bf16_text = "with " + " ".join(bf16)
    else:
        bf16_text = "bf16 " + ("native" if has_fast_bf16() else "emulated")
    return f"{name}, {os.cpu_count()} cores, {bf16_text}"
