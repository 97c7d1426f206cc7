"""The one config of `prefixgym train`: SFT warm start, then GRPO, on one env.

Every field's docstring is its `--help` text. The defaults are the main job: the
built-in `tiny` model learning the built-in GuessNumber env on two CPU cores.
"""

from __future__ import annotations

from dataclasses import dataclass

from prefixgym.trainer.tracking import TRACKERS
from prefixgym.types import JSONObject

LOSSES = ("importance_sampling", "ppo")
LR_SCHEDULES = ("constant", "cosine")
DEFAULT_ENV = "prefixgym/GuessNumber-v0"
DEFAULT_ENV_KWARGS: JSONObject = {"max_turns": 4}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")


def default_env_kwargs(env: str) -> JSONObject:
    """The env kwargs a run uses when none are given."""
    return dict(DEFAULT_ENV_KWARGS) if env == DEFAULT_ENV else {}


@dataclass
class TrainConfig:
    env: str = DEFAULT_ENV
    """The env to train on: a registered id, module:id, module:Class or
    path/to/file.py:Class (docs/envs.md)."""
    env_kwargs: JSONObject | None = None
    """Keyword arguments for the env, e.g. {"high": 32}. Unset: {"max_turns": 4} for the
    default GuessNumber (binary search then wins 94%, so there is room to learn), {} for
    any other env."""
    model: str = "tiny"
    """A built-in preset (tiny, small) or a local Hugging Face checkpoint directory."""
    out: str = "runs/latest"
    """Directory for metrics.jsonl, report.md, plots and checkpoints."""
    seed: int = 0
    """Seed of the model init, the env seeds and the sampler."""
    sft_steps: int = 65
    """Warm-start steps of cross-entropy on expert episodes (0 skips the warm start).
    The default stops short (~55% on the default env) to leave GRPO room; ~80 steps
    already imitate the expert's binary search (~90%), the env's ceiling being 94%."""
    sft_episodes_per_step: int = 16
    """Expert episodes per warm-start step."""
    sft_lr: float = 2e-3
    """Learning rate of the warm start."""
    steps: int = 60
    """GRPO steps."""
    groups_per_step: int = 16
    """Groups (distinct env seeds) per GRPO step: B."""
    group_size: int = 8
    """Episodes per group, all reset with one seed: G."""
    lr: float = 3e-4
    """GRPO learning rate."""
    lr_schedule: str = "cosine"
    """GRPO learning-rate schedule: constant, or cosine (decay from --lr to --lr/10 over
    the steps, so the final weights are not a snapshot of a noisy large step)."""
    loss: str = "ppo"
    """GRPO loss: importance_sampling or ppo."""
    kl_coef: float = 0.0
    """Penalty on the sampled tokens' log-ratio to the warm-start weights (0 = off)."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's reward std."""
    max_tokens: int = 8
    """Tokens one assistant turn may sample."""
    temperature: float = 1.0
    """Sampling temperature during GRPO (evaluation is greedy)."""
    eval_every: int = 30
    """Evaluate every this many GRPO steps (and before and after training)."""
    eval_episodes: int = 1000
    """Held-out seeds per evaluation."""
    async_mode: bool = False
    """Sample step t+1 while step t trains (at most one step off-policy)."""
    deterministic: bool = True
    """Fix every batch the engine runs by the rollout schedule (each turn of all live
    episodes is one round, run alone, in episode order), so that a run's results depend
    only on its seed and config; off, requests batch as they arrive (faster, but the
    last bits of logprobs, and after a few updates the run, vary)."""
    resume: bool = False
    """Continue from the last checkpoint in OUT/checkpoints."""
    checkpoint_every: int = 10
    """Save resumable state every this many GRPO steps."""
    compute_dtype: str = "auto"
    """Training compute dtype: float32, bfloat16 (autocast, fp32 master weights; about 2x
    faster where the CPU has bf16 matmuls, about 2x slower where it emulates them), or
    auto: bfloat16 where bf16 matmuls are native (AVX512-BF16 or AMX, a bf16 GPU), else
    float32."""
    share_prefixes: bool = True
    """Compute each token prefix shared by a training call's datums once (exact; off runs
    every datum in full, the reference path)."""
    num_threads: int = 0
    """torch threads (0 = torch's default)."""
    progress: bool = True
    """Show a progress bar."""
    tracker: str = ""
    """Also send every metrics line to an experiment tracker: tensorboard (event files
    in OUT/tensorboard; needs `pip install 'prefixgym[tracking]'`), or empty for none."""
    sampler_url: str = ""
    """OpenAI-compatible completions server for rollouts and evaluation (vLLM, SGLang,
    prefixgym serve), e.g. http://host:8000/v1; empty samples in-process. The server
    samples from its own weights: trained weights are not sent to it."""

    def __post_init__(self) -> None:
        if self.env_kwargs is None:
            self.env_kwargs = default_env_kwargs(self.env)
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}")
        if self.loss not in LOSSES:
            raise ValueError(f"--loss must be one of {', '.join(LOSSES)}, got {self.loss!r}")
        if self.lr_schedule not in LR_SCHEDULES:
            raise ValueError(f"--lr-schedule must be one of {', '.join(LR_SCHEDULES)}, "
                             f"got {self.lr_schedule!r}")
        if self.tracker not in TRACKERS:
            raise ValueError(f"--tracker must be tensorboard or empty, got {self.tracker!r}")
        if self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}, "
                             f"got {self.compute_dtype!r}")
        positive = {
            "groups_per_step": self.groups_per_step, "group_size": self.group_size,
            "max_tokens": self.max_tokens, "eval_episodes": self.eval_episodes,
            "sft_episodes_per_step": self.sft_episodes_per_step,
            "eval_every": self.eval_every, "checkpoint_every": self.checkpoint_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
        for name, value in {"steps": self.steps, "sft_steps": self.sft_steps,
                            "num_threads": self.num_threads}.items():
            if value < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        for name, rate in {"lr": self.lr, "sft_lr": self.sft_lr}.items():
            if not rate > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {rate}")
        if self.kl_coef < 0 or self.temperature < 0:
            raise ValueError("--kl-coef and --temperature must be >= 0")
        if self.group_size < 2:
            raise ValueError(
                f"--group-size must be at least 2 (group-relative advantages), got "
                f"{self.group_size}"
            )
