"""Load a tokenizer: the built-in byte-level BPE, or any local Hugging Face one.

`load_tokenizer("builtin")` gives the 4096-token BPE shipped in `prompting/assets/`
(trained by `prompting/build_tokenizer.py`), with its ChatML chat template, `eos_token`
and `pad_token` set. Any other argument is a local directory that
`AutoTokenizer.from_pretrained` can read; nothing is ever downloaded, and no code
from the directory ever runs (`trust_remote_code=False`: a tokenizer_config.json
whose `auto_map` names the directory's own Python class is refused, where
transformers would otherwise ask on stdin whether to run it).

`end_of_turn_ids(tokenizer)` gives the ids a sampler stops at by default. This module
knows nothing about chat formats beyond the template string it attaches, and nothing
about models.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from prefixgym.prompting.build_tokenizer import (
    ASSETS_DIR,
    EOS_TOKEN,
    IM_END,
    IM_START,
    VOCAB_SIZE,
)

BUILTIN = "builtin"

__all__ = [
    "BUILTIN",
    "EOS_TOKEN",
    "IM_END",
    "IM_START",
    "VOCAB_SIZE",
    "builtin_chat_template",
    "end_of_turn_ids",
    "is_builtin_tokenizer",
    "load_tokenizer",
    "load_tokenizer_dir",
    "resolve_tokenizer",
]


def load_tokenizer(name_or_dir: str | Path = BUILTIN) -> PreTrainedTokenizerFast:
    """The built-in tokenizer ("builtin") or the one in a local HF tokenizer directory.

    The built-in tokenizer is loaded once per process and the same instance is returned
    every time (tokenizers are mutable: do not change it; load a directory copy with
    `load_tokenizer(ASSETS_DIR)` if you must). Raises ValueError for anything else.
    """
    if str(name_or_dir) == BUILTIN:
        return _load_builtin()
    path = Path(name_or_dir)
    if not path.is_dir():
        raise ValueError(
            f"tokenizer {str(name_or_dir)!r} is neither 'builtin' nor a local directory; "
            "prefixgym never downloads tokenizers, so give a directory that holds "
            "tokenizer.json (or the files of a Hugging Face tokenizer)"
        )
    tokenizer = load_tokenizer_dir(path)
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ValueError(
            f"the tokenizer in {str(path)!r} is {type(tokenizer).__name__}; prefixgym needs a "
            "fast tokenizer (a directory with tokenizer.json)"
        )
    return tokenizer


def load_tokenizer_dir(path: str | Path) -> PreTrainedTokenizerBase:
    """Whatever tokenizer transformers reads from local directory `path` (fast or
    slow), without downloading and without running code from the directory.
    ValueError, in one line, otherwise."""
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True,
                                             trust_remote_code=False)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        if "trust_remote_code" in str(e):
            raise ValueError(
                f"the tokenizer in {str(path)!r} would run Python code from that directory "
                "(an auto_map entry in its tokenizer_config.json or config.json); prefixgym "
                "never runs code from a model directory"
            ) from None
        raise ValueError(f"cannot load a tokenizer from directory {str(path)!r}: "
                         f"{type(e).__name__}: {' '.join(str(e).split())}") from None


@functools.lru_cache(maxsize=1)
def _load_builtin() -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(ASSETS_DIR / "tokenizer.json"),
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        clean_up_tokenization_spaces=False,
        model_max_length=1_000_000,
    )
    tokenizer.name_or_path = BUILTIN
    tokenizer.chat_template = builtin_chat_template()
    if len(tokenizer) != VOCAB_SIZE:
        raise RuntimeError(
            f"shipped tokenizer has {len(tokenizer)} tokens, want {VOCAB_SIZE}; "
            "rebuild it with `python -m prefixgym.prompting.build_tokenizer`"
        )
    return tokenizer


@functools.lru_cache(maxsize=1)
def builtin_chat_template() -> str:
    """The Jinja chat template shipped with the built-in tokenizer (ChatML)."""
    return (ASSETS_DIR / "chat_template.jinja").read_text(encoding="utf-8")


def is_builtin_tokenizer(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether `tokenizer` is the shipped BPE (the same instance, or a copy loaded from disk)."""
    if tokenizer is _load_builtin():
        return True
    return (
        len(tokenizer) == VOCAB_SIZE
        and tokenizer.convert_tokens_to_ids([IM_START, IM_END, EOS_TOKEN])
        == _load_builtin().convert_tokens_to_ids([IM_START, IM_END, EOS_TOKEN])
        and tokenizer.get_vocab() == _load_builtin().get_vocab()
    )


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase,
                    checkpoint_dir: str | Path | None = None) -> tuple[int, ...]:
    """The ids that end an assistant turn: the tokenizer's eos, where the vocabulary has
    it ChatML's `<|im_end|>`, and every id of the `eos_token_id` a checkpoint's
    generation_config.json lists (an instruct model's turn end: Gemma's `<end_of_turn>`,
    Llama 3's `<|eot_id|>`), as transformers' `generate` and vLLM stop at them. A sampler
    stops at these unless told otherwise."""
    ids: list[int] = []
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        ids.append(eos)
    im_end = tokenizer.convert_tokens_to_ids(IM_END)
    if isinstance(im_end, int) and im_end != getattr(tokenizer, "unk_token_id", None):
        ids.append(im_end)
    ids += _generation_config_eos(checkpoint_dir)
    return tuple(dict.fromkeys(ids))


def _generation_config_eos(checkpoint_dir: str | Path | None) -> list[int]:
    """The `eos_token_id` (an int or a list) of the directory's generation_config.json;
    none where there is no such file or it is not JSON."""
    path = Path(checkpoint_dir) / "generation_config.json" if checkpoint_dir else None
    if path is None or not path.is_file():
        return []
    try:
        eos = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return []
    eos = eos if isinstance(eos, list) else [eos]
    return [i for i in eos if isinstance(i, int) and not isinstance(i, bool) and i >= 0]


def resolve_tokenizer(
    tokenizer: PreTrainedTokenizerBase | str | Path | None, checkpoint_dir: str | Path | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer for a service: a tokenizer object as is, a directory (or "builtin")
    loaded, and for None the checkpoint directory's own, or the built-in one without one."""
    if tokenizer is not None and not isinstance(tokenizer, (str, Path)):
        return tokenizer
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    return load_tokenizer(checkpoint_dir if checkpoint_dir is not None else BUILTIN)
