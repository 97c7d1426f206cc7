"""What this machine computes fast: the facts the engine's dtype choices rest on.

`has_fast_bf16()` says whether bf16 matmuls run natively. On an x86 CPU that is
AVX512-BF16 or AMX; without them oneDNN still "supports" bf16 by emulating it with
AVX512, and a training step then runs about 2.3x slower than in fp32 (tiny preset,
64 x 100 tokens: 15.1 s vs 6.5 s on an AVX512 Xeon without AVX512-BF16). Knows torch
and the CPU; nothing of models.
"""

from __future__ import annotations

import platform

import torch


def has_fast_bf16() -> bool:
    """Whether bf16 matmuls run natively: a CUDA GPU with bf16, an x86 CPU with
    AVX512-BF16 or AMX, or another CPU (ARM) for which oneDNN reports bf16."""
    if torch.cuda.is_available():
        return bool(torch.cuda.is_bf16_supported())
    if platform.machine().lower() in ("x86_64", "amd64", "i386", "i686"):
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
