"""Find a chat template on disk: a `.jinja` file, a `tokenizer_config.json`, or a model dir.

Returns the template text and the BOS/EOS strings the file declares. Knows nothing
about rendering or checking a template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from prefixgym.prompting.findings import LintInputError
from prefixgym.types import JSONObject


@dataclass(frozen=True)
class TemplateSource:
    template: str
    bos_token: str | None
    eos_token: str | None
    origin: str


def _token_text(value: object) -> str | None:
    # tokenizer_config.json stores special tokens as strings or as AddedToken dicts
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _template_from_config(config: JSONObject, origin: str) -> str | None:
    raw = config.get("chat_template")
    if raw is None:
        return None
    if isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {t.get("name"): t.get("template") for t in raw if isinstance(t, dict)}
        chosen = named.get("default")
        if not isinstance(chosen, str):
            raise LintInputError(
                f"{origin}: chat_template is a list of named templates without a 'default' "
                f"(names: {sorted(str(n) for n in named)})"
            )
        return chosen
    raise LintInputError(f"{origin}: chat_template must be a string or a list, got {type(raw).__name__}")


def _read_json(path: Path) -> JSONObject:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise LintInputError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise LintInputError(f"{path}:{exc.lineno}: invalid JSON: {exc.msg}") from None
    if not isinstance(data, dict):
        raise LintInputError(f"{path}: expected a JSON object")
    return data


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise LintInputError(f"{path}: cannot read: {exc}") from None


def load_template(
    path: str | Path, bos_token: str | None = None, eos_token: str | None = None
) -> TemplateSource:
    """Load the chat template at `path`; explicit `bos_token`/`eos_token` win over the file's."""
    p = Path(path)
    if not p.exists():
        raise LintInputError(f"{p}: no such file or directory")
    config: JSONObject = {}
    template: str | None = None
    if p.is_dir():
        config_path = p / "tokenizer_config.json"
        if config_path.is_file():
            config = _read_json(config_path)
        if (p / "chat_template.jinja").is_file():
            template = _read_text(p / "chat_template.jinja")
        else:
            template = _template_from_config(config, str(config_path))
        if template is None:
            raise LintInputError(f"{p}: no chat_template.jinja and no chat_template in tokenizer_config.json")
    elif p.suffix == ".json":
        config = _read_json(p)
        template = _template_from_config(config, str(p))
        if template is None:
            raise LintInputError(f"{p}: has no 'chat_template' field")
    else:
        template = _read_text(p)
    return TemplateSource(
        template=template,
        bos_token=bos_token if bos_token is not None else _token_text(config.get("bos_token")),
        eos_token=eos_token if eos_token is not None else _token_text(config.get("eos_token")),
        origin=str(p),
    )
