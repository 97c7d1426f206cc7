"""End-to-end smoke runs of `prefixgym train` on a tiny budget: metric keys, the
per-phase accounting identities, exact resume, and failing envs."""

import json

import pytest
import torch
from numerics import DTYPES

from prefixgym.cli import main as cli_main
from prefixgym.cli.train import train
from prefixgym.envs.registration import make_env
from prefixgym.local_service import LocalService
from prefixgym.pricing import money, run_prices
from prefixgym.prompting.lint.trace import analyze_trace
from prefixgym.prompting.lint.trace_file import load_trace
from prefixgym.rollouts.rollout import RolloutConfig
from prefixgym.trainer import run as run_module
from prefixgym.trainer import sft
from prefixgym.trainer.config import TrainConfig
from prefixgym.trainer.grpo import assemble, collect, grpo_step
from prefixgym.trainer.report import usage_of
from prefixgym.types import Usage

MKL = torch.backends.mkl.is_available()
SMALL = dict(env="tests/Lengthy-v0", sft_steps=1, sft_episodes_per_step=2, groups_per_step=2,
             group_size=3, eval_episodes=4, eval_every=2, max_tokens=6, progress=False)


@pytest.fixture
def thread_count_restored():
    """`--num-threads` sets torch's count for the process: put it back for other tests."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def make_envs(config, n):
    return [make_env(config.env, config.env_kwargs) for _ in range(n)]


def _grpo_lines(out):
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("time/")}
            for r in lines if r["phase"] in ("grpo", "eval")]


def test_accounting_identities():
    config = TrainConfig(**SMALL, steps=1)
    with LocalService(model="tiny", seed=0) as service:
        training = service.create_training_client()
        sampler = service.create_sampling_client()
        envs = make_envs(config, 6)
        groups, _ = collect(sampler, service.tokenizer, envs, config, 0,
                            RolloutConfig(max_tokens=6))
        datums, _ = assemble(groups, config)
        assert datums, "the test env gives varied rewards, so some group trains"
        metrics, usage = grpo_step(training, groups, config, None)
    turns = [t for g in groups for traj in g.trajectories for t in traj.turns]
    requests = [t for t in turns if t.usage.prefill_tokens]  # a shared turn counts once
    assert usage.prefill_computed_tokens + usage.prefill_cached_tokens == sum(
        t.prompt_length for t in requests)
    assert len(requests) == len(groups) * (1 + config.group_size)  # 1 shared + 1 each
    assert usage.sampled_tokens == sum(t.num_sampled_tokens for t in turns)
    # a token prefix shared by datums (the group's prompt) is computed once
    inputs = [d.model_input.tokens for d in datums]
    assert usage.train_computed_tokens == len(
        {tuple(t[: k + 1]) for t in inputs for k in range(len(t))})
    assert usage.train_tokens == sum(d.model_input.length for d in datums)
    assert usage.train_shared_tokens > 0
    assert usage.train_loss_tokens == sum(
        sum(1 for w in d.loss_fn_inputs["weights"] if w) for d in datums)
    # weights are 1 exactly on the sampled tokens of each trained episode
    assert usage.train_loss_tokens == sum(
        t.num_sampled_tokens for g in groups for traj in g.trajectories for t in traj.turns
        if len(set(x.total_reward for x in g.trajectories)) > 1)
    assert metrics["reward/mean"] == pytest.approx(
        sum(traj.total_reward for g in groups for traj in g.trajectories) / 6)


def test_cli_run_writes_metrics_report_plots_and_checkpoints(tmp_path, numerics):
    out = tmp_path / "run"
    args = ["train", "--out", str(out), "--steps", "2"]
    for k, v in SMALL.items():
        if k == "progress":
            args.append("--no-progress")
        else:
            args += [f"--{k.replace('_', '-')}", str(v)]
    assert cli_main(args) == 0
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["phase"] == "grpo"]
    assert [r["step"] for r in steps] == [0, 1]
    for key in ["step", "reward/mean", "tokens/prefill_computed", "tokens/prefill_cached",
                "tokens/sampled", "tokens/train_computed", "tokens/train_loss", "time/step_s"]:
        assert all(key in r for r in steps), key
    evals = [r for r in records if r["phase"] == "eval"]
    assert [e["when"] for e in evals] == ["after warm start", "GRPO"]  # a preset: random init
    assert all("eval/reward/mean" in e for e in evals)
    report = (out / "report.md").read_text()
    assert "prefill, served from the prefix cache" in report and "train, in the loss" in report
    # what `auto` chose (here the test dtype: tests/conftest.py) and on how many threads
    assert f"Trained in {numerics.name} on {torch.get_num_threads()} threads of cpu (" in report
    assert all((out / f"{name}.png").stat().st_size > 0 for name in ("training", "tokens", "time"))
    assert (out / "checkpoints" / "latest").read_text() == "step-000001"
    # seconds per phase: each GRPO step, evaluation and warm-start step splits its time
    # (sequential in a deterministic run: within its wall time), and report.md sums them
    engine_phases = ["prefill", "decode", "forward_backward", "optim_step", "publish"]
    for r in steps:
        split = [r[f"time/{p}_s"] for p in engine_phases]
        assert all(v >= 0 for v in split) and r["time/env_s"] >= 0
        assert r["time/prefill_s"] > 0 and r["time/forward_backward_s"] > 0
        assert sum(split) <= r["time/step_s"]
    for e in evals:
        assert e["time/prefill_s"] > 0 and e["time/forward_backward_s"] == 0
        assert e["time/prefill_s"] + e["time/decode_s"] <= e["time/eval_s"]
    sft = [r for r in records if r["phase"] == "sft"]
    assert sft and all(r["time/forward_backward_s"] > 0 and r["time/prefill_s"] == 0
                       and r["time/forward_backward_s"] <= r["time/step_s"] for r in sft)
    table = report[report.index("## Seconds per phase"):report.index("## Tokens per phase")]
    grpo_row = next(line for line in table.splitlines() if line.startswith("| GRPO |"))
    assert grpo_row.split(" | ")[1] == f"{sum(r['time/step_s'] for r in steps):.1f} s"
    assert "| **whole run** |" in table
    # money per phase: the whole run's tokens (every metrics line's) at the reference rates
    total = Usage.total(usage_of(r) for r in records)
    prices, _ = run_prices("tiny")
    money_section = report[report.index("## Money per phase"):report.index("## Tokens per")]
    total_row = next(line for line in money_section.splitlines() if "**total**" in line)
    cells = [c.strip() for c in total_row.strip("|").split("|")]
    assert cells[2] == f"**{money(total.cost(prices).total)}**"
    assert f"Priced at the rates of {prices.model}" in money_section
    # the full resolved config, in the report and in every checkpoint
    config = json.loads((out / "config.json").read_text())
    assert config["steps"] == 2 and config["deterministic"] is True
    for name in ("step-000001", "warm_start"):
        assert json.loads((out / "checkpoints" / name / "config.json").read_text()) == config
    assert json.dumps(config, sort_keys=True) in report


class Killed(Exception):
    pass


@pytest.mark.parametrize("numerics", DTYPES, ids=str)
@pytest.mark.parametrize("async_mode", [False, True])
def test_same_run_same_metrics_and_resume_continues_exactly(tmp_path, monkeypatch, async_mode,
                                                            numerics, thread_count_restored):
    """Deterministic mode (the default): the engine's batches are fixed by the rollout
    schedule, so two runs of one config log the same numbers, bit for bit (steps 0-1 of
    "a" and "c"), and a run killed after a checkpoint and resumed logs what the
    uninterrupted run did (steps 2-3), in either compute dtype. In fp32 where torch uses
    MKL, "a" runs on 2 threads and "c" on 1: the thread count changes no bits (MKL's
    strict mode). bf16 matmuls run in oneDNN, which splits reductions by thread count
    (docs/architecture.md "Determinism"): there the claim is the same count, 2 and 2."""
    any_count = numerics.name == "float32" and MKL

    def run(out, resume=False):
        config = TrainConfig(**{**SMALL, "eval_episodes": 2}, steps=4, checkpoint_every=2,
                             out=str(tmp_path / out), resume=resume, async_mode=async_mode,
                             compute_dtype=numerics.name,
                             num_threads=1 if out == "c" and any_count else 2)
        train(config)

    # (the plots are test_cli_run_writes_metrics_report_plots_and_checkpoints's to check)
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    run("a")
    save = run_module.save_checkpoint

    def save_then_die(out, training, state, *args, **kwargs):
        path = save(out, training, state, *args, **kwargs)
        if state.next_step == 2:
            raise Killed  # while step 2 samples, in async mode step 3 too
        return path

    with monkeypatch.context() as patch:
        patch.setattr(run_module, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            run("c")
    run("c", resume=True)
    a, c = _grpo_lines(tmp_path / "a"), _grpo_lines(tmp_path / "c")
    assert [r["step"] for r in c if r["phase"] == "grpo"] == [0, 1, 2, 3]
    assert sum(1 for r in a if r.get("tokens/train_computed")) >= 2, "steps must train"
    assert a == c


@pytest.mark.parametrize("numerics", DTYPES, ids=str)
def test_a_warm_start_killed_after_a_checkpoint_resumes_exactly(tmp_path, monkeypatch, capsys,
                                                                numerics):
    """The warm start checkpoints every `checkpoint_every` steps: a run killed after its
    step 5 was saved resumes there and logs what the uninterrupted run did, every line
    (the first evaluation, the warm start's, the evaluations and GRPO steps after), and
    counts the same usage; the warm start's own checkpoints go once it has ended."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])

    def run(out, resume=False):
        train(TrainConfig(**{**SMALL, "eval_episodes": 2, "sft_steps": 7}, eval_on_start=True,
                          steps=2, checkpoint_every=2, keep_checkpoints=1,
                          out=str(tmp_path / out), resume=resume, compute_dtype=numerics.name))

    def lines(out):
        return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")}
                for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]

    run("a")
    save = run_module.save_checkpoint
    kept = []

    def save_then_die(out, training, state, *args, **kwargs):
        root = out / "checkpoints"
        kept.append(sorted(p.name for p in root.iterdir()) if root.exists() else [])
        path = save(out, training, state, *args, **kwargs)
        if state.next_sft_step == 6:
            raise Killed
        return path

    with monkeypatch.context() as patch:
        patch.setattr(run_module, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            run("c")
    assert kept == [[], ["sft-000001"], ["sft-000003"]]  # keep_checkpoints=1 holds here too
    assert [r.get("sft_step") for r in lines("c")][-1] == 5
    capsys.readouterr()
    run("c", resume=True)
    assert f"resuming from {tmp_path / 'c' / 'checkpoints' / 'sft-000005'} at warm-start " \
           "step 6" in capsys.readouterr().err
    a, c = lines("a"), lines("c")
    assert [r["sft_step"] for r in c if r["phase"] == "sft"] == list(range(7))
    assert [r["when"] for r in c if r["phase"] == "eval"] == [
        "before training", "after warm start", "GRPO"]
    assert a == c
    for name in ("warm_start", "step-000001"):
        saved = [json.loads((tmp_path / out / "checkpoints" / name / "loop.json").read_text())
                 for out in ("a", "c")]
        assert [(s["usage"], s["sft_usage"]) for s in saved[:1]] == \
            [(s["usage"], s["sft_usage"]) for s in saved[1:]]
    assert sorted(p.name for p in (tmp_path / "c" / "checkpoints").iterdir()) == [
        "latest", "step-000001", "warm_start"]


@pytest.mark.parametrize("numerics", DTYPES, ids=str)
def test_a_resume_on_another_thread_count_says_when_bits_will_differ(
        tmp_path, monkeypatch, capsys, numerics, thread_count_restored):
    """bf16 rounds by thread count, fp32 (MKL) does not: resumed on 1 thread after 2,
    a bf16 run says its steps will not repeat the uninterrupted run's bits."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    config = dict(SMALL, sft_steps=0, eval_episodes=1, checkpoint_every=1, out=str(tmp_path),
                  compute_dtype=numerics.name)
    train(TrainConfig(**config, steps=1, num_threads=2))
    capsys.readouterr()
    train(TrainConfig(**config, steps=2, num_threads=1, resume=True))
    err = capsys.readouterr().err
    assert "resuming from" in err
    assert ("threads 2 -> 1" in err) == numerics.is_bf16


def test_evaluating_the_random_init_is_opt_in_and_changes_nothing_else(tmp_path, monkeypatch):
    """A built-in preset starts from a random init, which the run does not evaluate
    unless asked; asked, that evaluation is the only line of metrics.jsonl that differs
    (its prompts leave the prefix cache with blocks of other weights)."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])

    def run(out, **kwargs):
        config = TrainConfig(**SMALL, steps=2, out=str(tmp_path / out), **kwargs)
        train(config)
        return config, _grpo_lines(tmp_path / out)

    config, default = run("default")
    assert config.eval_on_start is False
    _, asked = run("asked", eval_on_start=True)
    assert [r["when"] for r in asked if r["phase"] == "eval"] == [
        "before training", "after warm start", "GRPO"]
    assert [r for r in asked if r.get("when") != "before training"] == default
    assert sum(1 for r in default if r.get("tokens/train_computed")) >= 1, "steps must train"


def test_a_run_keeps_its_newest_step_checkpoints(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    out = tmp_path / "run"
    train(TrainConfig(**{**SMALL, "eval_episodes": 2}, steps=4, checkpoint_every=1,
                      keep_checkpoints=2, out=str(out)))
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == [
        "latest", "step-000002", "step-000003", "warm_start"]
    with pytest.raises(ValueError, match="--keep-checkpoints must be >= 0"):
        TrainConfig(keep_checkpoints=-1)


def test_checkpoints_without_the_optimizer_are_a_third_and_resume_with_a_fresh_adamw(
        tmp_path, monkeypatch, capsys):
    """--no-checkpoint-optimizer: the training state holds the weights and not AdamW's
    two moments (at full fine-tuning, a third of the bytes); a run resumed from it says
    AdamW starts afresh there and goes on from the saved weights."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])

    def state_bytes(out):
        step = out / "checkpoints" / "step-000000"
        manifest = json.loads((step / "checkpoint.json").read_text())
        return sum(p.stat().st_size for p in (step / "train").rglob("*")), manifest

    config = dict(SMALL, sft_steps=0, eval_episodes=1, checkpoint_every=1)
    train(TrainConfig(**config, steps=1, out=str(tmp_path / "full")))
    train(TrainConfig(**config, steps=1, out=str(tmp_path / "lean"), checkpoint_optimizer=False))
    (full, full_manifest), (lean, lean_manifest) = (state_bytes(tmp_path / "full"),
                                                    state_bytes(tmp_path / "lean"))
    assert full_manifest["optimizer"] is True and lean_manifest["optimizer"] is False
    assert lean < 0.4 * full
    capsys.readouterr()
    train(TrainConfig(**config, steps=1, out=str(tmp_path / "full"), resume=True,
                      checkpoint_optimizer=False))  # (a resumable change)
    assert "AdamW starts afresh" not in capsys.readouterr().err  # it held the moments
    train(TrainConfig(**config, steps=2, out=str(tmp_path / "lean"), resume=True,
                      checkpoint_optimizer=False))
    err = capsys.readouterr().err
    assert "resuming from" in err and "AdamW starts afresh" in err
    assert [r["step"] for r in _grpo_lines(tmp_path / "lean") if r["phase"] == "grpo"] == [0, 1]


def test_failing_env_is_left_out_and_counted():
    config = TrainConfig(**{**SMALL, "env_kwargs": {"raise_on_seed": None}}, steps=1)
    with LocalService(model="tiny", seed=0) as service:
        envs = make_envs(config, 6)
        seed0 = 3_000_000  # GRPO_SEED_BASE + seed 0, step 0, group 0
        for env in envs[:3]:
            env.unwrapped.raise_on_seed = seed0
        groups, _ = collect(service.create_sampling_client(), service.tokenizer, envs,
                            config, 0, RolloutConfig(max_tokens=6))
        assert all(t.failed for t in groups[0].trajectories)
        assert not any(t.failed for t in groups[1].trajectories)
        datums, counts = assemble(groups, config)
    assert counts["episodes/failed"] == 3.0
    assert all(d.model_input.length > 0 for d in datums)


@pytest.mark.parametrize("extra", [{"async_mode": True}, {"kl_coef": 0.1}])
def test_async_mode_and_kl_penalty_run(tmp_path, monkeypatch, extra):
    # the GRPO steps are what this checks: one evaluation episode, no plots
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    config = {**SMALL, "eval_episodes": 1, "eval_every": 10}
    trace = tmp_path / "trace.jsonl"
    result = train(TrainConfig(**config, steps=3, out=str(tmp_path), trace=str(trace), **extra))
    # the trace holds every sampling request: the linter counts what report.md counts
    report = analyze_trace(load_trace(trace))
    assert report.observed_tokens == {
        "prefill_computed_tokens": result.usage.prefill_computed_tokens,
        "prefill_cached_tokens": result.usage.prefill_cached_tokens,
        "sampled_tokens": result.usage.sampled_tokens}
    assert report.append_only  # each episode's id is its own in the run
    # the KL reference's passes bypass the cache (PG205), and are all the linter finds
    assert [f.rule for f in report.findings] == (["PG205"] if "kl_coef" in extra else [])
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if r["phase"] == "grpo"]
    assert [r["step"] for r in steps] == [0, 1, 2]
    if "kl_coef" in extra:
        trained = [r for r in steps if r["datums/count"]]
        assert trained and all("kl/sampled_vs_ref" in r for r in trained)
        if steps[0]["datums/count"]:  # step 0 samples from the reference weights themselves
            assert abs(steps[0]["kl/sampled_vs_ref"]) < 1e-4
    assert result.usage.train_computed_tokens > 0


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_sft_lr_schedule_constant_holds_the_peak_after_the_warm_up(tmp_path, monkeypatch,
                                                                    schedule):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    config = {**SMALL, "sft_steps": 10, "eval_episodes": 1}
    train(TrainConfig(**config, steps=0, sft_lr=1e-3, sft_lr_schedule=schedule,
                      out=str(tmp_path)))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["optim/learning_rate"] for r in lines if r["phase"] == "sft"]
    assert len(lrs) == 10 and lrs[0] == pytest.approx(1e-3)  # a one-step warm-up (10%)
    if schedule == "constant":
        assert lrs == pytest.approx([1e-3] * 10)
    else:
        assert lrs[-1] < 0.2e-3


def test_the_warm_start_runs_its_stages_in_order_without_a_warm_up(tmp_path, monkeypatch):
    """Two stages of Arithmetic's expert: always calling, then never; no warm-up."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    seen: list[tuple[float, bool]] = []  # per warm-start step: the lr, any call in its datums
    real = run_module.warm_start

    def spy(training, envs, tokenizer, steps, per_step, lr, **kwargs):
        call = tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
        stages = kwargs["stages"]
        assert [n for n, _ in stages] == [2, 3]
        for n, stage_envs in stages:
            datums = sft.expert_datums(stage_envs, tokenizer, list(range(8)))
            seen.append((n, any(call in _reply_tokens(d) for d in datums)))
        return real(training, envs, tokenizer, steps, per_step, lr, **kwargs)

    monkeypatch.setattr(run_module, "warm_start", spy)
    stages = [{"steps": 2, "env_kwargs": {"expert_tool_rate": 1.0}},
              {"steps": 3, "env_kwargs": {"expert_tool_rate": 0.0}}]
    train(TrainConfig(env="prefixgym/Arithmetic-v0", env_kwargs={"num_operands": 2},
                      sft_steps=5, sft_stages=stages, sft_warmup=0.0, sft_lr=1e-3,
                      sft_lr_schedule="constant", sft_episodes_per_step=2, steps=0,
                      eval_episodes=1, max_tokens=4, progress=False, out=str(tmp_path)))
    assert seen == [(2, True), (3, False)]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["optim/learning_rate"] for r in lines if r["phase"] == "sft"] == \
        pytest.approx([1e-3] * 5)  # no warm-up: the peak from the first step
    assert [r["sft_stage"] for r in lines if r["phase"] == "sft"] == [1, 1, 2, 2, 2]
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["sft_stages"] == stages and saved["sft_warmup"] == 0.0


def test_warm_start_stages_switch_envs_at_their_step_and_must_cover_the_steps():
    """Each step trains on episodes of its stage's expert; the seeds run on."""
    service = LocalService(model="tiny", seed=0, num_threads=1, thread_tuning=False)
    tokenizer = service.tokenizer
    call = tokenizer.encode("<tool_call>", add_special_tokens=False)[0]
    calling, answering = ([make_env("prefixgym/Arithmetic-v0", {"num_operands": 2,
                                    "expert_tool_rate": rate})] for rate in (1.0, 0.0))

    training = service.create_training_client()

    class Recorder:  # the training protocol's two calls, recording each step's datums
        def __init__(self) -> None:
            self.steps: list[list[list[int]]] = []

        def forward_backward(self, datums, loss_fn):
            self.steps.append([_reply_tokens(d) for d in datums])
            return training.forward_backward(datums, loss_fn)

        def optim_step(self, adam):
            return training.optim_step(adam)

    recorder = Recorder()
    sft.warm_start(recorder, calling, tokenizer, 5, 3, 1e-3,
                   stages=[(2, calling), (3, answering)])
    assert [all(call in t for t in step) for step in recorder.steps] == [True] * 2 + [False] * 3
    assert len({tuple(t) for step in recorder.steps for t in step}) > 5  # the seeds run on
    with pytest.raises(ValueError, match="cover 4 steps, not 5"):
        sft.warm_start(recorder, calling, tokenizer, 5, 3, 1e-3,
                       stages=[(2, calling), (2, answering)])


def _reply_tokens(datum) -> list[int]:
    """The tokens a warm-start datum trains on: the expert's replies."""
    inputs = datum.loss_fn_inputs
    return [int(t) for t, w in zip(inputs["target_tokens"], inputs["weights"]) if w > 0]
