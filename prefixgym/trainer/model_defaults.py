"""The defaults of a run on a pretrained model: `--model` a checkpoint directory or a
.gguf file.

`TrainConfig`'s field defaults are sized for the built-in `tiny` (a 5M random init that
learns from scratch): on a pretrained checkpoint they destroy it (SmolLM2-135M-Instruct
went from 16% train reward to 0% in 6 steps). `pretrained_defaults` gives the values
such a run takes instead, for the settings no layer set (flags, `--config`, a resumed
run's saved config.json):

- `lr` 3e-5 (full fine-tuning; measured: SmolLM2-135M-Instruct from 24.5% to 98.0% on
  an addition env in 24 GRPO steps, issue 61) or 2e-4 with `--lora-rank` (not measured
  here: LoRA wants about ten times full fine-tuning's rate, and a default errs low);
- `sft_lr` the same: a warm start on a pretrained model fine-tunes it too;
- `sft_steps` 0: an env's scripted expert taught `tiny` its format, it is no teacher of
  a pretrained model, so a warm start runs only when asked;
- `max_tokens` 64: room for an instruct model's short sentence with its answer (8 cut
  most of them: a cut reply never ends its turn, and GRPO would learn brevity before
  the task); a task that reasons longer wants more;
- `eval_episodes` 200: a standard error of at most 3.5 points (at 50%); 1,500 (1.2
  points, for `tiny`'s cheap replies) would sample, over a default run's three
  evaluations, more than half as many episodes as its GRPO steps do.

Knows settings by field name, not where they came from: `cli/train_args.py` applies
them under every layer and `cli/train.py` says in the run's first lines which it took.
"""

from __future__ import annotations

from prefixgym.trainer.config import TrainConfig, is_pretrained_checkpoint
from prefixgym.types import JSONObject

PRETRAINED_LR = 3e-5
"""--lr (and --sft-lr) of full fine-tuning on a checkpoint directory."""
PRETRAINED_LORA_LR = 2e-4
"""--lr (and --sft-lr) of LoRA (--lora-rank > 0) on a checkpoint directory."""
PRETRAINED_SETTINGS: JSONObject = {"sft_steps": 0, "max_tokens": 64, "eval_episodes": 200}
"""The rest of a checkpoint directory's defaults (why: the module's docstring)."""


def pretrained_defaults(settings: JSONObject) -> JSONObject:
    """The checkpoint directory's defaults of the fields `settings` (every layer, merged)
    does not set; nothing when its `model` is a built-in preset."""
    if not is_pretrained_checkpoint(str(settings.get("model", TrainConfig.model))):
        return {}
    lr = PRETRAINED_LORA_LR if settings.get("lora_rank") else PRETRAINED_LR
    defaults: JSONObject = {"lr": lr, "sft_lr": lr, **PRETRAINED_SETTINGS}
    return {name: value for name, value in defaults.items() if name not in settings}


def pretrained_defaults_line(defaults: JSONObject) -> str:
    """The run's first-lines account of the `pretrained_defaults` it took."""
    flags = ", ".join(f"--{name.replace('_', '-')} {flag_value(value)}"
                      for name, value in defaults.items())
    return (f"pretrained-model defaults (--model is a pretrained checkpoint): {flags} "
            "(flags and --config settings you give win; docs/models.md)")


def flag_value(value: object) -> str:
    """A value as it is typed on the command line: 3e-5 and 2e-4, not 3e-05 and 0.0002."""
    if not isinstance(value, float):
        return str(value)
    mantissa, _, exponent = f"{value:e}".partition("e")
    return min(repr(value), f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}", key=len)
