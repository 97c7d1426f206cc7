"""The one config of `prefixgym train`: SFT warm start, then GRPO, on one env.

Every field's docstring is its `--help` text. The defaults are the main job: the
built-in `tiny` model learning the built-in GuessNumber env on two CPU cores. A run on
a checkpoint directory or a .gguf file (a pretrained model) takes its own defaults for
the fields sized for `tiny` (`model_defaults.py`; the command line applies them).
`__post_init__` fills in the fields left unset and checks them all, one group of
fields at a time. Which fields determine a run's results: `identity.py`.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field

from prefixgym.files import is_gguf_path
from prefixgym.trainer.tracking import TRACKERS
from prefixgym.types import (
    DECOUPLED_LOSS_FN_NAMES,
    OFF_POLICY_LOSS_FN_NAMES,
    TRAINING_DEFAULTS,
    JSONObject,
    check_training_settings,
)

GRPO_LOSSES = OFF_POLICY_LOSS_FN_NAMES
"""GRPO's losses: all but the warm start's cross_entropy (those that read sampler logprobs)."""
RUN_CONFIG = "config.json"
"""The run's full resolved config, in its directory: written when it starts, read
back by --resume and `prefixgym rollout --run`."""
LR_SCHEDULES = ("constant", "cosine")
OFF_POLICY_CORRECTIONS = ("none", "tis", "mis")
OFF_POLICY_LEVELS = ("token", "sequence")
OFF_POLICY_RATIOS = ("sampler", "trainer")
DEFAULT_ENV = "prefixgym/GuessNumber-v0"
DEFAULT_ENV_KWARGS: JSONObject = {"max_turns": 4, "expert_noise": 0.5, "invalid_penalty": 1.0}
COMPUTE_DTYPES = ("auto", "float32", "bfloat16")
BACKENDS = ("local", "tinker")
LORA_TARGETS = ("attn", "mlp", "unembed")


def is_pretrained_checkpoint(model: str) -> bool:
    """Whether `--model` names a pretrained model on disk (a checkpoint directory or a
    .gguf file) rather than a built-in preset (a random init) or a hosted model."""
    return os.path.isdir(model) or (is_gguf_path(model) and os.path.isfile(model))


def default_env_kwargs(env: str) -> JSONObject:
    """The env kwargs a run uses when none are given."""
    return dict(DEFAULT_ENV_KWARGS) if env == DEFAULT_ENV else {}


@dataclass
class TrainConfig:
    env: str = DEFAULT_ENV
    """The env to train on: a registered id, module:id, module:Class or
    path/to/file.py:Class (docs/envs.md)."""
    env_kwargs: JSONObject | None = None
    """Keyword arguments for the env, e.g. {"high": 32}. Unset: {"max_turns": 4,
    "expert_noise": 0.5, "invalid_penalty": 1.0} for the default GuessNumber (binary
    search then wins 94%; the warm start imitates an expert that guesses at random on
    half its turns and wins 70%, so GRPO has a better strategy to find; an invalid
    reply costs as much as a win earns, so an episode that wins after one scores about
    what a failed one does, its speed bonus only), {} for any other env."""
    agent: str = ""
    """An agent program to train instead of an env: path/to/file.py:fn, module:fn or an
    entry point of the prefixgym.agents group (docs/agents.md). It is called with
    base_url, api_key, model and task, talks to the model through OpenAI's API at
    base_url, and returns its reward; every call's tokens are recorded as sampled."""
    tasks: str = ""
    """With --agent: a JSONL file, one task (any JSON value) a line, passed to the program
    as `task`; a GRPO group runs one task G times. `env`: the tasks --env's reset poses,
    one per group seed ({"env", "env_kwargs", "seed", "system", "tools", "messages"})."""
    eval_tasks: str = ""
    """With --agent: held-out tasks (JSONL) to evaluate on; unset: the first of --tasks."""
    sft_data: str = ""
    """A warm start on recorded runs instead of the env's expert: a JSONL file of sequences
    as `prefixgym proxy --record` writes them (an expert model's runs of the agent program,
    in this model's tokenizer); --sft-steps steps of --sft-episodes-per-step of them."""
    agent_timeout: float = 300.0
    """With --agent: seconds one rollout of the program may take; a slower one fails."""
    model: str = "tiny"
    """A built-in preset (tiny, small), a local Hugging Face checkpoint directory
    (config.json, *.safetensors and its tokenizer) of a supported family (docs/models.md)
    or a .gguf file (converted once to a cached directory; needs `pip install
    'prefixgym[gguf]'`); its chat template builds the prompts turn by turn (a template
    that rewrites earlier replies, as reasoning models' do, is said in the first lines).
    A pretrained model takes its own defaults of --lr, --sft-lr, --sft-steps, --max-tokens
    and --eval-episodes for those not set, said in the first lines."""
    chat_template: str = ""
    """A chat template to use instead of --model's own (a base model's GGUF file often has
    none): a .jinja file, a tokenizer_config.json or a model directory (a checkpoint
    only)."""
    chat_template_kwargs: JSONObject | None = None
    """The chat template's switches, passed to every render, e.g. {"enable_thinking":
    false} (a checkpoint's template only)."""
    lora_rank: int = 0
    """Train LoRA adapters of this rank on the frozen model instead of every weight (0:
    full training). The adapter is written to OUT/adapter in PEFT's format."""
    lora_alpha: float = 32.0
    """LoRA scale numerator: the update is scaled by alpha / rank."""
    lora_targets: str = "attn,mlp"
    """Comma-separated layers that get adapters: attn (q, k, v, o projections), mlp
    (gate, up, down), unembed (the output head)."""
    out: str = "runs/latest"
    """Directory for metrics.jsonl, report.md, plots and checkpoints."""
    seed: int = 0
    """Seed of the model init, the env seeds and the sampler."""
    sft_steps: int = 400
    """Warm-start steps of cross-entropy on expert episodes (0 skips the warm start).
    The default imitates the default env's noisy expert to convergence: every seed
    measured lands at 57-68% sampled success, the env's ceiling being 94%. Stopping
    short of an exact expert instead leaves a seed-dependent warm start (GuessNumber:
    26-48% at 65 steps; docs/benchmarks.md). --model a checkpoint directory: 0 unless
    set (an env's expert is no teacher of a pretrained model; docs/models.md)."""
    sft_episodes_per_step: int = 16
    """Expert episodes per warm-start step."""
    sft_lr: float = 2e-3
    """Learning rate of the warm start. --model a checkpoint directory: --lr's default
    there (3e-5, LoRA 2e-4) unless set."""
    sft_lr_schedule: str = "cosine"
    """Warm-start learning-rate schedule after its linear warm-up (--sft-warmup):
    cosine (decay to --sft-lr/10) or constant (stay at --sft-lr, for skills learned
    late, such as copying from the context: docs/benchmarks.md, "Tool use on
    Arithmetic")."""
    sft_warmup: float = 0.1
    """Share of the warm-start steps over which its learning rate rises linearly from
    zero (0: none). On Arithmetic's tool calls a warm-up delayed the copy of the
    question into the call past step 150 on a seed that copied by 150 without one."""
    sft_stages: list[JSONObject] = field(default_factory=list)
    """The warm start in stages, one after another under one learning-rate schedule,
    e.g. [{"steps": 250, "env_kwargs": {"expert_tool_rate": 1.0}}, {"steps": 50}]:
    each stage imitates the expert of the env built with --env-kwargs updated by the
    stage's env_kwargs; their steps must add up to --sft-steps. A first stage can teach
    a skill (calling the calculator) that a last one then uses less, leaving GRPO a
    choice to learn. Empty: every step imitates the expert of --env-kwargs."""
    steps: int = 60
    """GRPO steps."""
    groups_per_step: int = 16
    """Groups (distinct env seeds) per GRPO step: B."""
    group_size: int = 8
    """Episodes per group, all reset with one seed: G."""
    lr: float = 6e-4
    """GRPO learning rate. --model a checkpoint directory (a pretrained model): 3e-5, or
    2e-4 with --lora-rank, unless set (docs/models.md)."""
    lr_schedule: str = "cosine"
    """GRPO learning-rate schedule: constant, or cosine (decay from --lr to --lr/10 over
    the steps, so the final weights are not a snapshot of a noisy large step)."""
    loss: str = "ppo"
    """GRPO loss: importance_sampling, ppo, cispo, dro, gspo or stable_reinforce."""
    kl_coef: float = 0.0
    """Penalty on the sampled tokens' log-ratio to the warm-start weights (0 = off)."""
    off_policy_correction: str = "none"
    """Correct for the sampler not being the policy trained (a remote or bf16 sampler,
    --async, --max-staleness): none; tis, truncated importance sampling (weights
    pi_old/pi_sampler cut at --off-policy-cap); or mis, masked (tokens whose weight is
    outside [--off-policy-mask-low, --off-policy-mask-high] leave the loss). pi_old is
    the trainer's own logprob before the update (docs/scaling.md, "Off-policy
    samples"). Every GRPO loss; the local backend."""
    off_policy_level: str = "token"
    """The correction's weight per token, or per sequence (the geometric mean of its loss
    tokens' weights, given to all of them)."""
    off_policy_ratio: str = "sampler"
    """The corrected loss's ratio: sampler, pi_theta/pi_sampler as uncorrected (a ppo or
    gspo clip stays a trust region around the sampler's policy; a token the cap or mask
    does not touch trains as uncorrected; verl's bypass mode), or trainer,
    pi_theta/pi_old (decoupled: the clip is around the weights before the update, which
    one update per batch never reaches; losses importance_sampling, ppo, cispo, gspo)."""
    off_policy_cap: float = 2.0
    """tis: the largest importance weight (verl's rollout_is_threshold default); >= 1."""
    off_policy_mask_low: float = 0.125
    """mis: weights below this are masked (prime-rl's mask_ratio_low default); in [0, 1]."""
    off_policy_mask_high: float = 8.0
    """mis: weights above this are masked (prime-rl's mask_ratio_high default); >= 1."""
    normalize_std: bool = True
    """Divide group-relative advantages by the group's reward std."""
    max_tokens: int = 8
    """Tokens one assistant turn may sample. --model a checkpoint directory: 64 unless
    set (an instruct model's short reply; docs/models.md)."""
    temperature: float = 1.0
    """Sampling temperature during GRPO (evaluation: --eval-temperature)."""
    eval_every: int = 30
    """Evaluate every this many GRPO steps (and before and after training)."""
    eval_episodes: int = 1500
    """Held-out seeds per evaluation (standard error of a success rate near 65%: 1.2
    points). --model a checkpoint directory: 200 unless set (3.5 points at most)."""
    eval_on_start: bool | None = None
    """Evaluate the starting weights before training. Unset: yes for a checkpoint
    directory or a hosted model; no for a built-in preset (tiny, small), whose starting
    weights are a random init: it wins nothing, and its replies all run to --max-tokens,
    which makes it a run's slowest evaluation (about 50 s of the default run)."""
    eval_temperature: float | None = None
    """Sampling temperature of the evaluations. Unset: the GRPO --temperature, so they
    score the policy GRPO trains (one sample per held-out seed, seeded: repeatable).
    0: greedy, the most likely reply, which can fall while the sampled policy improves
    (on the default env greedy success moves in steps of the 16 hidden numbers whose
    most likely reply changes; docs/benchmarks.md)."""
    async_mode: bool = False
    """Sample step t+1 while step t trains (at most one step off-policy): --max-staleness 1."""
    max_staleness: int = 0
    """K: sample up to K steps ahead of the trainer, each from the newest weights when it
    starts, so a sample trains at most K policy versions after the weights that drew it
    (0: synchronous; 1: --async). A step whose samples are more than K versions old is
    dropped and counted (episodes/stale); staleness/<lag> counts the episodes trained at
    each lag. Each version sampled from stays in memory until its steps are sampled; with
    --sampler-url the servers keep the newest K + 1 LoRA adapters loaded (full weights:
    K = 0 only, a server holds one version)."""
    deterministic: bool = True
    """Fix every batch the engine runs by the rollout schedule (each turn of all live
    episodes is one round, run alone, in episode order), so that a run's results depend
    only on its seed and config; off, requests batch as they arrive (faster, but the
    last bits of logprobs, and after a few updates the run, vary)."""
    resume: bool = False
    """Continue from the newest intact checkpoint of this run in OUT/checkpoints (a run
    with nothing to continue from starts anew)."""
    force_resume: bool = False
    """With --resume, also load a checkpoint of another run (one whose config differs
    in a field that determines results)."""
    checkpoint_every: int = 10
    """Save resumable state every this many GRPO steps."""
    keep_checkpoints: int = 2
    """GRPO step checkpoints kept, the newest (an older one is the fallback when the
    newest is damaged); older ones are deleted. The warm start's is always kept. 0
    keeps every one."""
    checkpoint_optimizer: bool = True
    """Checkpoints hold AdamW's state (twice the weights trained, in fp32), so that a
    resumed run goes on as the uninterrupted one. --no-checkpoint-optimizer keeps the
    weights, step and RNG states only (full fine-tuning: a third of the size); a run
    resumed from such a checkpoint starts AdamW afresh, and says so."""
    compute_dtype: str = "auto"
    """Training compute dtype: float32, bfloat16 (autocast, fp32 master weights; about 2x
    faster where the CPU has bf16 matmuls, about 2x slower where it emulates them), or
    auto: bfloat16 where bf16 matmuls are native (AVX512-BF16 or AMX, a bf16 GPU), else
    float32."""
    nonfinite_update: str = TRAINING_DEFAULTS.nonfinite_update
    """An update whose gradient norm is NaN or inf: skip (weights unchanged, counted as
    optim/skipped_nonfinite in metrics.jsonl) or error (stop the run)."""
    share_prefixes: bool = TRAINING_DEFAULTS.share_prefixes
    """Compute each token prefix shared by a training call's datums once (exact; off runs
    every datum in full, the reference path)."""
    router_aux_loss_coef: float = TRAINING_DEFAULTS.router_aux_loss_coef
    """A mixture-of-experts model's router load-balancing loss, times this, joins the
    training loss (transformers' `router_aux_loss_coef`); 0 (off) as RL recipes train.
    Must be >= 0."""
    recompute_activations: bool = TRAINING_DEFAULTS.recompute_activations
    """Keep only each transformer block's input for backward and run the block again
    there: far less activation memory for about a third more training compute; the
    same gradients (docs/lora.md, "Memory")."""
    fsdp: bool = False
    """Under torchrun, shard the trained weights, their gradients and AdamW's state over
    the ranks (FSDP2) instead of holding them whole on each (DDP), for a model whose
    training state outgrows one device; every rank still holds the whole weights once,
    for sampling (docs/scaling.md). Checkpoints are the same either way: a run resumes
    with or without it, on any number of ranks."""
    num_threads: int = 0
    """torch threads (0 = torch's default)."""
    device: str = "auto"
    """Where the model trains and samples: cpu, cuda, cuda:N, mps, or auto (a GPU when
    torch sees one, else the CPU); the run's first line says which."""
    progress: bool = True
    """Show a progress bar."""
    tracker: str = ""
    """Also send every metrics line to an experiment tracker: tensorboard (event files
    in OUT/tensorboard; needs `pip install 'prefixgym[tracking]'`), trackio (its local
    store, project prefixgym; needs `pip install 'prefixgym[trackio]'`), or empty for
    none."""
    sampler_url: list[str] = field(default_factory=list)
    """OpenAI-compatible completions server for rollouts and evaluation (SGLang,
    prefixgym serve; vLLM with LoRA), e.g. http://host:8000/v1; repeat the flag for
    several (episodes stick to one, groups spread by load, a failed one is left out).
    Every update is pushed to them from OUT/sampler_weights, which they must be able to
    read (a shared filesystem). None: sample in-process."""
    trace: str = ""
    """Also write every sampling request of the run (GRPO, evaluations, the KL
    reference's) to this JSONL file, the trace `prefixgym lint trace` reads; its counts
    are report.md's. Under torchrun, rank N > 0 writes FILE.rankN.jsonl. A resumed run
    writes the requests of its own process."""
    prices: str = ""
    """A price table (TOML, docs/files.md) whose rows go on top of the shipped one, the
    hosted service's published rates: report.md prices the run's tokens per phase."""
    price_model: str = ""
    """The price table's row to price the run at (e.g. Qwen/Qwen3-8B). Unset: the row
    --model names, else Qwen/Qwen3-8B's, as what the same tokens would cost there."""
    backend: str = "local"
    """Where training and sampling run: local (the built-in engine) or tinker (the hosted
    service, docs/tinker.md: API key from TINKER_API_KEY, --model names its base model,
    LoRA rank 32 unless --lora-rank says otherwise)."""

    def __post_init__(self) -> None:
        self._fill_unset()
        self._check_choices()
        self._check_numbers()
        self.sft_stages = _checked_stages(self.sft_stages, self.sft_steps)
        self._check_off_policy()
        self._check_combinations()

    @property
    def staleness(self) -> int:
        """K, the versions a sample may lag: --max-staleness, at least 1 with --async."""
        return max(self.max_staleness, int(self.async_mode))

    def _fill_unset(self) -> None:
        """The fields whose default depends on others, and a saved run's older forms."""
        if isinstance(self.sampler_url, str):  # a run saved before the flag repeated
            self.sampler_url = [self.sampler_url] if self.sampler_url else []
        if self.env_kwargs is None:
            self.env_kwargs = default_env_kwargs(self.env)
        if self.eval_temperature is None:
            self.eval_temperature = self.temperature
        if self.eval_on_start is None:  # a local model is a preset unless it is a directory
            self.eval_on_start = self.backend != "local" or is_pretrained_checkpoint(self.model)

    def _check_choices(self) -> None:
        """Fields that name one of a few things."""
        if not all(isinstance(u, str) and u for u in self.sampler_url):
            raise ValueError(f"--sampler-url must be URLs, got {self.sampler_url!r}")
        if not isinstance(self.env_kwargs, dict):
            raise ValueError(f"--env-kwargs must be a JSON object, got {self.env_kwargs!r}")
        _require_one_of("--loss", self.loss, GRPO_LOSSES)
        _require_one_of("--lr-schedule", self.lr_schedule, LR_SCHEDULES)
        _require_one_of("--sft-lr-schedule", self.sft_lr_schedule, LR_SCHEDULES)
        _require_one_of("--backend", self.backend, BACKENDS)
        targets = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        if not targets or set(targets) - set(LORA_TARGETS):
            raise ValueError(f"--lora-targets must be a comma-separated subset of "
                             f"{', '.join(LORA_TARGETS)}, got {self.lora_targets!r}")
        if self.tracker not in TRACKERS:
            raise ValueError(f"--tracker must be tensorboard, trackio or empty, got "
                             f"{self.tracker!r}")
        _require_one_of("--compute-dtype", self.compute_dtype, COMPUTE_DTYPES)

    def _check_numbers(self) -> None:
        """Every float finite, then each number in its range."""
        for name, value in asdict(self).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{_flag(name)} must be a finite number, got {value}")
        positive = {
            "groups_per_step": self.groups_per_step, "group_size": self.group_size,
            "max_tokens": self.max_tokens, "eval_episodes": self.eval_episodes,
            "sft_episodes_per_step": self.sft_episodes_per_step,
            "eval_every": self.eval_every, "checkpoint_every": self.checkpoint_every,
        }
        for name, value in positive.items():
            if value < 1:
                raise ValueError(f"{_flag(name)} must be at least 1, got {value}")
        for name, value in {"steps": self.steps, "sft_steps": self.sft_steps,
                            "num_threads": self.num_threads, "max_staleness": self.max_staleness,
                            "keep_checkpoints": self.keep_checkpoints}.items():
            if value < 0:
                raise ValueError(f"{_flag(name)} must be >= 0, got {value}")
        for name, rate in {"lr": self.lr, "sft_lr": self.sft_lr}.items():
            if not rate > 0:
                raise ValueError(f"{_flag(name)} must be positive, got {rate}")
        if not 0 <= self.sft_warmup < 1:
            raise ValueError(f"--sft-warmup must be in [0, 1), got {self.sft_warmup}")
        if self.lora_rank < 0 or not self.lora_alpha > 0:
            raise ValueError(f"--lora-rank must be >= 0 and --lora-alpha positive, got "
                             f"{self.lora_rank} and {self.lora_alpha}")
        assert self.eval_temperature is not None  # filled in by _fill_unset
        if min(self.kl_coef, self.temperature, self.eval_temperature) < 0:
            raise ValueError("--kl-coef, --temperature and --eval-temperature must be >= 0")
        check_training_settings(self.nonfinite_update, self.router_aux_loss_coef, _flag)
        if not self.agent_timeout > 0:
            raise ValueError(f"--agent-timeout must be positive, got {self.agent_timeout}")
        if self.group_size < 2:
            raise ValueError(
                f"--group-size must be at least 2 (group-relative advantages), got "
                f"{self.group_size}"
            )

    def _check_off_policy(self) -> None:
        """The correction's fields, and the loss and backend it needs."""
        _require_one_of("--off-policy-correction", self.off_policy_correction,
                        OFF_POLICY_CORRECTIONS)
        _require_one_of("--off-policy-level", self.off_policy_level, OFF_POLICY_LEVELS)
        _require_one_of("--off-policy-ratio", self.off_policy_ratio, OFF_POLICY_RATIOS)
        if self.off_policy_cap < 1:
            raise ValueError(f"--off-policy-cap must be >= 1, got {self.off_policy_cap}")
        if not 0 <= self.off_policy_mask_low <= 1 <= self.off_policy_mask_high:
            raise ValueError("--off-policy-mask-low and --off-policy-mask-high need 0 <= low <= 1 "
                             f"<= high, got {self.off_policy_mask_low}, "
                             f"{self.off_policy_mask_high}")
        if self.off_policy_correction == "none":
            return
        if self.off_policy_ratio == "trainer" and self.loss not in DECOUPLED_LOSS_FN_NAMES:
            raise ValueError(f"--off-policy-ratio trainer needs --loss "
                             f"{', '.join(DECOUPLED_LOSS_FN_NAMES)}; {self.loss}'s penalty is on the "
                             "log-ratio to the sampler itself")
        if self.backend != "local":
            raise ValueError("--off-policy-correction runs on the local backend only (the "
                             "hosted service's losses take no such setting)")

    def _check_combinations(self) -> None:
        """Flags that go only with others, or not with others."""
        if self.fsdp and self.backend != "local":
            raise ValueError("--fsdp shards the built-in engine's training over torchrun "
                             "ranks; --backend tinker trains on the hosted service")
        if self.backend == "tinker" and self.sampler_url:
            raise ValueError("--sampler-url and --backend tinker do not go together: the "
                             "hosted service samples")
        if (self.tasks or self.eval_tasks) and not self.agent:
            raise ValueError("--tasks and --eval-tasks go with --agent")
        if self.agent and self.sft_steps and not self.sft_data:
            raise ValueError("an --agent run's warm start imitates recorded runs: pass "
                             "--sft-data FILE.jsonl (prefixgym proxy --record), or --sft-steps 0")
        if self.sft_data and not self.sft_steps:
            raise ValueError("--sft-data needs --sft-steps N: the warm-start steps on it")
        if self.sft_data and self.sft_stages:
            raise ValueError("--sft-stages change the env's expert stage by stage; they do not "
                             "go with --sft-data")


def loss_fn_config(config: TrainConfig) -> dict[str, float] | None:
    """forward_backward's loss_fn_config for the run's off-policy correction (None: none;
    the keys are the engine's, `engine/trainer/off_policy.py`)."""
    if config.off_policy_correction == "none":
        return None
    if config.off_policy_correction == "tis":
        out = {"off_policy_tis_cap": config.off_policy_cap}
    else:
        out = {"off_policy_mis_low": config.off_policy_mask_low,
               "off_policy_mis_high": config.off_policy_mask_high}
    return {**out, "off_policy_sequence": float(config.off_policy_level == "sequence"),
            "off_policy_decoupled": float(config.off_policy_ratio == "trainer")}


def _checked_stages(stages: object, sft_steps: int) -> list[JSONObject]:
    """`--sft-stages` as a list of {"steps": int, "env_kwargs": dict}, covering
    `sft_steps`; ValueError naming the stage otherwise."""
    if not isinstance(stages, list):
        raise ValueError(f"--sft-stages must be a list of stages, got {stages!r}")
    checked: list[JSONObject] = []
    for i, stage in enumerate(stages):
        where = f"--sft-stages: stage {i + 1}"
        if not isinstance(stage, dict):
            raise ValueError(f"{where} must be an object like {{\"steps\": 100}}, got {stage!r}")
        unknown = set(stage) - {"steps", "env_kwargs"}
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)}; a stage has steps "
                             "and env_kwargs")
        steps, kwargs = stage.get("steps"), stage.get("env_kwargs", {})
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"{where} needs steps, an integer >= 1, got {steps!r}")
        if not isinstance(kwargs, dict):
            raise ValueError(f"{where}: env_kwargs must be an object, got {kwargs!r}")
        checked.append({"steps": steps, "env_kwargs": kwargs})
    total = sum(int(stage["steps"]) for stage in checked)
    if checked and total != sft_steps:
        raise ValueError(f"--sft-stages cover {total} warm-start steps and --sft-steps is "
                         f"{sft_steps}: make them equal")
    return checked


def _flag(name: str) -> str:
    """A field's flag: `sft_lr` -> `--sft-lr`."""
    return "--" + name.replace("_", "-")


def _require_one_of(flag: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{flag} must be one of {', '.join(choices)}, got {value!r}")
