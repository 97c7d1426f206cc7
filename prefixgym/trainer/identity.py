"""A run's identity: the part of its config that determines its results.

`run_identity(config)` is every field of a `TrainConfig` but those in
`RESUMABLE_CHANGES`, which a `--resume` may change (how far the run goes, how often it
evaluates and checkpoints, where samples come from, how it shows progress). A
checkpoint records its run's identity; `--resume` refuses one with another identity.
A config or identity saved before a field existed reads as the run it was
(`ADDED_FIELDS`). Knows the config's fields, not how a checkpoint stores them.
"""

from __future__ import annotations

from dataclasses import asdict, fields

from prefixgym.trainer.config import TrainConfig
from prefixgym.types import JSONObject

RESUMABLE_CHANGES = (
    "out", "resume", "force_resume", "steps", "eval_every", "checkpoint_every",
    "num_threads", "device", "progress", "sampler_url", "nonfinite_update", "share_prefixes",
    "recompute_activations", "eval_on_start", "keep_checkpoints", "prices", "price_model",
    "trace", "checkpoint_optimizer", "fsdp",
)
"""Fields a resumed run may set differently from the run it continues. `steps` extends
(or shortens) a run; with the cosine schedule the remaining steps then follow the new
length. `sampler_url` moves sampling to another server, whose weights are its own.
`num_threads` changes no fp32 bits (MKL's strict mode, docs/architecture.md
"Determinism"; bf16 rounds by thread count, and a resume that changes it says so);
`device` moves the run (its numbers round otherwise there, which a resume says);
`share_prefixes` and `fsdp` change how the same sums are computed, not what;
`recompute_activations` changes only what is kept for backward (bit-for-bit the same).
`eval_on_start` only matters to a new run (a resumed one has evaluated already);
`prices` and `price_model` only price the report; `trace` only writes what was sampled.
Every other field determines results (`eval_episodes` too: evaluations before and
after the change would not compare)."""

ADDED_FIELDS: JSONObject = {"eval_temperature": 0.0, "sft_lr_schedule": "cosine",
                            "sft_warmup": 0.1, "sft_stages": [], "chat_template_kwargs": None,
                            "router_aux_loss_coef": 0.0, "agent": "", "tasks": "",
                            "eval_tasks": "", "agent_timeout": 300.0,
                            "sft_data": "", "chat_template": ""}
ADDED_FIELDS.update({"off_policy_correction": "none", "off_policy_level": "token",
                     "off_policy_cap": 2.0, "off_policy_mask_low": 0.125,
                     "off_policy_mask_high": 8.0, "max_staleness": 0,
                     "off_policy_ratio": "sampler"})
"""Fields added after runs were saved, with the value that gives what a run saved
without them did (it evaluated greedily, its warm start warmed up over 10% of its
steps, decayed on the cosine and imitated one expert throughout; a correction took
the decoupled form, `off_policy_ratio` "trainer", which `with_added_fields` sets):
`with_added_fields` fills them into a saved config or checkpoint identity, so such
runs still resume as themselves."""


def with_added_fields(saved: JSONObject) -> JSONObject:
    filled = {**ADDED_FIELDS, **saved}
    if "off_policy_ratio" not in saved and filled["off_policy_correction"] != "none":
        filled["off_policy_ratio"] = "trainer"  # the only form before the field
    return filled


def run_identity(config: TrainConfig) -> JSONObject:
    """The fields that determine the run's results (all but `RESUMABLE_CHANGES`)."""
    return {k: v for k, v in asdict(config).items() if k not in RESUMABLE_CHANGES}


def saved_run_identity(saved: JSONObject) -> JSONObject:
    """The identity of a run from its saved config.json (fields it lacks take their
    defaults; ValueError when the saved values are not a valid config)."""
    names = {f.name for f in fields(TrainConfig)}
    try:
        return run_identity(TrainConfig(**{k: v for k, v in with_added_fields(saved).items()
                                           if k in names}))
    except TypeError as e:
        raise ValueError(f"not a prefixgym train config: {e}") from None
