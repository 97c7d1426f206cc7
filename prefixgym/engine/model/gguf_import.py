"""A `.gguf` file (llama.cpp's, Ollama's) as a Hugging Face checkpoint directory,
converted once and cached.

`checkpoint_dir_of(path)` gives the directory `load_hf_checkpoint` and the tokenizer
loader read: config.json, model.safetensors (every tensor dequantised to float32) and
the tokenizer files, with the GGUF's chat template when it carries one. The work is
transformers' GGUF reader's (the `gguf` package, an optional extra:
`pip install 'prefixgym[gguf]'`):

1) hash the file (SHA-256: the same bytes convert once, wherever they lie);
2) the cached directory `CACHE/gguf/<stem>-<hash>` when it is there (it appears whole
   or not at all: written under a temporary name, then renamed);
3) otherwise, under a lock (two processes loading one file convert it once), read the
   config, the tokenizer and the dequantised weights through transformers, and write
   them as a Hugging Face directory.

Why a cache instead of dequantising at every load: reading a GGUF's metadata parses
every vocabulary entry in Python (18 s for Gemma 3's 262k tokens here), and
transformers reads it three times (config, tokenizer, weights): converting took 35 s
for SmolLM2-135M and 90 s for Gemma 3 270M on 2 cores, where reading the converted
directory takes a few seconds. The cost is disk: 4 bytes a parameter (0.54 GB for
135M), under `$PREFIXGYM_CACHE_DIR`, else `$XDG_CACHE_HOME/prefixgym`, else
`~/.cache/prefixgym`; deleting it only costs the next load a conversion. float32
because a dequantised value (a block scale times a 4-6 bit code, plus an offset)
needs more bits than bf16 or fp16 keep; `--compute-dtype` decides what runs.

Knows files and transformers' GGUF reader; runs no model and no tokenizer.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import sys
from pathlib import Path

from prefixgym.files import CACHE_VARIABLE, cache_root, is_gguf_path, write_dir_atomically

__all__ = ["CACHE_VARIABLE", "cache_root", "checkpoint_dir_of", "is_gguf_path"]

CONVERSION = 1
"""Bumped when the conversion changes what it writes: older cached directories are then
converted again (the number is in the directory's name)."""
GGUF_MAGIC = b"GGUF"
SOURCE_FILE = "gguf_source.json"
"""What a converted directory was made from: the file's name, hash and the reader."""


def checkpoint_dir_of(path: str | os.PathLike[str]) -> Path:
    """The Hugging Face directory of GGUF file `path`, converting it on first use (one
    line on stderr says so). ValueError, in one line, for a missing or unreadable file,
    a missing `gguf` package or an architecture transformers cannot read."""
    source = Path(path)
    if not source.is_file():
        raise ValueError(f"{source}: no such GGUF file")
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"{source}: reading a .gguf file needs the gguf package: "
                         "pip install 'prefixgym[gguf]'")
    # 1) the file's hash names its directory
    with open(source, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ValueError(f"{source}: not a GGUF file (it does not begin with "
                             f"{GGUF_MAGIC.decode()})")
        f.seek(0)
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    root = cache_root() / "gguf"
    target = root / f"{source.stem}-{digest[:16]}-v{CONVERSION}"
    # 2) converted before
    if (target / SOURCE_FILE).is_file():
        return target
    # 3) convert, once across processes
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"{source}: cannot write its conversion under {root}: "
                         f"{e.strerror or e} (set {CACHE_VARIABLE} to a writable directory)"
                         ) from None
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / SOURCE_FILE).is_file():
            print(f"prefixgym: converting {source} to a Hugging Face directory, once "
                  f"(dequantised to float32; cached in {target})", file=sys.stderr)
            write_dir_atomically(target, lambda tmp: _convert(source, digest, tmp))
    return target


def _convert(source: Path, digest: str, out: Path) -> None:
    """Write `source` as a Hugging Face directory into `out` (transformers' reading)."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(source.resolve().parent), source.name
    try:
        config = AutoConfig.from_pretrained(where, gguf_file=name, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, config=config,
                                                  local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            where, gguf_file=name, config=config, dtype=torch.float32, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError, NotImplementedError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{source}: transformers cannot read this GGUF file: {first}"
                         ) from None
    # The weights are plain float32 tensors now: saved as any checkpoint, not as a
    # quantized one (transformers refuses to save a model it still calls quantized).
    model.hf_quantizer = None  # type: ignore[assignment]  # (a plain attribute)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / SOURCE_FILE).write_text(json.dumps({
        "file": name, "sha256": digest, "conversion": CONVERSION,
        "transformers": transformers.__version__}, indent=2) + "\n")
