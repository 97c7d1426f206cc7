"""`prefixgym train`'s command line: flags, a config file or shipped recipe, and a
resumed run's saved config, resolved into one `TrainConfig` over its defaults (a
pretrained checkpoint's own for what none of them sets: `trainer/model_defaults.py`).

Kept apart from `train.py` so that `prefixgym train --help` and a usage error answer
before torch and the engine load (`cli/__init__.py` parses here first). Knows flags
and files; builds nothing.
"""

from __future__ import annotations

from pathlib import Path

from prefixgym.cli.flags import build_config, build_parser, read_config_file, read_json_object
from prefixgym.envs.registration import absolute_spec
from prefixgym.recipes import config_path, recipe_names
from prefixgym.trainer.config import RUN_CONFIG, TrainConfig
from prefixgym.trainer.identity import with_added_fields
from prefixgym.trainer.model_defaults import pretrained_defaults
from prefixgym.types import JSONObject

FLAG_NAMES = {"async_mode": "async", "lr": "lr"}


TRAIN_DESCRIPTION = ("SFT warm start on expert episodes, then GRPO, on one env; writes "
                     "metrics.jsonl, report.md, plots and checkpoints to --out.")


def parse_train_config(argv: list[str], prog: str = "prefixgym train",
                       description: str = TRAIN_DESCRIPTION) -> TrainConfig:
    """The run `argv` asks for; a bad flag or file exits with a usage error (code 2)."""
    return parse_train_args(argv, prog, description)[0]


def parse_train_args(argv: list[str], prog: str = "prefixgym train",
                     description: str = TRAIN_DESCRIPTION) -> tuple[TrainConfig, JSONObject]:
    """The run `argv` asks for, and the pretrained-model defaults it took (those of the
    settings no flag, file or saved config gave; none unless --model is a checkpoint
    directory or a .gguf file); a bad flag or file exits with a usage error (code 2)."""
    parser = build_parser(
        TrainConfig, prog=prog,
        description=f"{description} Settings come from the "
        "defaults, then a resumed run's saved config.json, then --config FILE.toml (or a "
        f"shipped recipe's name: {', '.join(recipe_names()) or 'none'}), then the flags given "
        "here. A pretrained checkpoint (--model DIR or FILE.gguf) has its own defaults: "
        "see --model.",
        flag_names=FLAG_NAMES, config_file=True,
    )
    given = vars(parser.parse_args(argv))
    try:
        from_file = (read_config_file(TrainConfig, config_path(given["config"]), FLAG_NAMES)
                     if "config" in given else {})
        saved = saved_run_config({**from_file, **given})
    except ValueError as e:
        parser.error(str(e))
    merged = {**saved, **from_file, **given}
    # under every layer, what none of them set: a checkpoint directory's defaults, and an
    # agent run's warm start (none: an agent program has no scripted expert)
    pretrained = pretrained_defaults(merged)
    agent = {"sft_steps": 0} if merged.get("agent") and "sft_steps" not in merged else {}
    config = build_config(TrainConfig, parser, {**pretrained, **agent}, saved, from_file, given)
    config.env = absolute_spec(config.env)
    return config, pretrained


def saved_run_config(settings: JSONObject) -> JSONObject:
    """With `resume` set, the config the run in `out` saved (nothing if it saved none)."""
    if not settings.get("resume"):
        return {}
    path = Path(settings.get("out", TrainConfig.out)) / RUN_CONFIG
    return with_added_fields(read_json_object(path)) if path.exists() else {}
