"""Every form of `--env` through train, rollout and lint env; entry points; resuming and
rolling out a run with its own env and settings; config files; one-line errors."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import gymnasium as gym
import pytest

from prefixgym.cli import main
from prefixgym.cli.flags import read_config_file
from prefixgym.cli.train_args import FLAG_NAMES
from prefixgym.envs.registration import absolute_spec, make_env
from prefixgym.recipes import config_path, recipe_names
from prefixgym.trainer.config import TrainConfig

ENV_MODULE = textwrap.dedent('''
    import itertools

    import gymnasium as gym
    from prefixgym.envs import AgentEnv, Outcome

    class Countdown(AgentEnv):
        """Say the number, then one less, until zero: a short stateful game."""

        system_prompt = "Count down to zero, one number per reply."

        def __init__(self, start: int = 3, max_turns: int = 4) -> None:
            super().__init__(max_turns=max_turns)
            self.start = start
            self.left = start

        def _reset_task(self) -> str:
            self.left = self.start
            return f"Start at {self.left}."

        def _act(self, text: str) -> Outcome:
            ok = text.strip() == str(self.left)
            self.left -= 1
            done = not ok or self.left < 0
            return Outcome("Next." if not done else "", rewards={"ok": float(ok)},
                           done=done, success=ok and self.left < 0)

        def expert_action(self) -> str:
            return str(self.left)

    class Silent(AgentEnv):
        """An env without an expert: any reply ends the episode."""

        system_prompt = "Say anything."

        def _reset_task(self) -> str:
            return "Go."

        def _act(self, text: str) -> Outcome:
            return Outcome("", rewards={"ok": 1.0}, done=True, success=True)

    class Unseeded(Countdown):
        """Countdown whose start ignores the seed (a server that draws its own secret)."""

        _starts = itertools.count(3)

        def _reset_task(self) -> str:
            self.start = next(self._starts)
            return super()._reset_task()

    OPEN: set[int] = set()  # the Tracked envs made and not closed

    class Tracked(Countdown):
        """Countdown, counting the instances not closed (a server session each, say)."""

        def __init__(self, **kwargs) -> None:
            super().__init__(**kwargs)
            OPEN.add(id(self))

        def close(self) -> None:
            OPEN.discard(id(self))

    class Flaky(Countdown):
        """Countdown whose server refuses the sessions of odd seeds."""

        def reset(self, *, seed=None, options=None):
            if seed is not None and seed % 2 == 1:
                raise ConnectionError("session refused: capacity reached")
            return super().reset(seed=seed, options=options)

    class NotAnEnv:
        pass

    if "formtest/Countdown-v0" not in gym.registry:
        gym.register("formtest/Countdown-v0", entry_point=Countdown)
''')

TINY_RUN = ["--steps", "1", "--sft-steps", "1", "--sft-episodes-per-step", "2",
            "--groups-per-step", "1", "--group-size", "2", "--eval-episodes", "2",
            "--max-tokens", "4", "--no-progress"]


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory holding the env module, importable only from there."""
    (tmp_path / "formtest_envs.py").write_text(ENV_MODULE)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "countdown_file.py").write_text(ENV_MODULE)
    monkeypatch.chdir(tmp_path)
    return tmp_path


FORMS = ["tests/Lengthy-v0", "formtest_envs:formtest/Countdown-v0", "formtest_envs:Countdown",
         "sub/countdown_file.py:Countdown"]


@pytest.mark.parametrize("spec", FORMS)
def test_each_env_form_trains_rolls_out_and_lints(
    workdir: Path, spec: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "run"
    assert main(["train", "--env", spec, "--out", str(out), *TINY_RUN]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["env"] == absolute_spec(spec)  # a file is saved by its absolute path
    assert saved["env"] == spec or saved["env"].startswith(str(workdir))
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0]
    capsys.readouterr()
    assert main(["rollout", "--env", spec, "--groups", "1", "--group-size", "1",
                 "--max-tokens", "4"]) == 0
    assert "== episode g0/0" in capsys.readouterr().out
    assert main(["lint", "env", spec, "--episodes", "1"]) == 0
    assert "append_only=yes" in capsys.readouterr().out


def test_env_kwargs_reach_the_env_in_every_command(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = "formtest_envs:Countdown"
    assert make_env(spec, {"start": 7}).unwrapped.start == 7
    assert main(["rollout", "--env", spec, "--env-kwargs", '{"max_turns": 1}', "--groups", "1",
                 "--group-size", "1", "--max-tokens", "4", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.count("  turn ") == 1  # one turn: max_turns=1
    # the expert needs start + 1 turns: with start=9 and max_turns=4 it runs out
    assert main(["lint", "env", spec, "--episodes", "1", "--env-kwargs",
                 '{"start": 9, "max_turns": 4}', "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == 4


def test_a_run_is_resumed_and_rolled_out_with_its_own_env_and_settings(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "run"
    spec = "formtest_envs:Countdown"
    assert main(["train", "--env", spec, "--env-kwargs", '{"start": 2}', "--out", str(out),
                 *TINY_RUN, "--steps", "0"]) == 0
    assert not (out / "checkpoints" / "latest").exists()  # only the warm start's checkpoint
    capsys.readouterr()
    # rollout --run: the run's env and kwargs, the warm-start weights
    assert main(["rollout", "--run", str(out), "--groups", "1", "--group-size", "1"]) == 0
    printed = capsys.readouterr().out
    assert "warm_start" in printed and "== episode g0/0" in printed
    # --resume with no --env: the run's own settings, from its warm-start checkpoint
    assert main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0
    assert "resuming from" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["env_kwargs"] == {"start": 2}
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in lines].count("sft") == 1  # kept, not run again
    assert [r["step"] for r in lines if r["phase"] == "grpo"] == [0, 1]
    assert [r["when"] for r in lines if r["phase"] == "eval"] == ["after warm start", "GRPO"]


def test_settings_come_from_a_config_file_and_flags_win(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (workdir / "run.toml").write_text(textwrap.dedent('''
        env = "formtest_envs:Countdown"
        env-kwargs = {start = 1}
        steps = 5
        group_size = 2
        groups-per-step = 1
        sft_steps = 0
        eval_episodes = 2
        max_tokens = 4
        async = false
        progress = false
    '''))
    out = workdir / "run"
    assert main(["train", "--config", "run.toml", "--steps", "1", "--out", str(out)]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert (saved["env"], saved["env_kwargs"], saved["steps"], saved["group_size"]) == (
        "formtest_envs:Countdown", {"start": 1}, 1, 2)
    (workdir / "bad.toml").write_text("stepz = 1\n")
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", "bad.toml"])
    assert e.value.code == 2 and "unknown setting 'stepz'" in capsys.readouterr().err


@pytest.mark.parametrize(("spec", "message"), [
    ("no_such_module:Countdown", "no module named 'no_such_module'"),
    ("sub/missing.py:Countdown", "sub/missing.py'"),  # train names it by its absolute path
    ("formtest_envs:NotAnEnv", "is not a gymnasium.Env subclass"),
    ("formtest_envs:Nothing", "has no class 'Nothing'"),
    ("CartPole-v1", "is not a prefixgym AgentEnv"),
    ("guess_number", "no env id 'guess_number' is registered; did you mean "
                     "'prefixgym/GuessNumber-v0'?"),
    ("Nothing-v3", "registered; the built-in envs are prefixgym/GuessNumber-v0, "),
])
def test_a_bad_env_is_one_line_and_exit_2_in_every_command(
    workdir: Path, spec: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    for argv in (["train", "--env", spec, "--out", str(workdir / "run"), "--no-progress"],
                 ["rollout", "--env", spec], ["lint", "env", spec]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert message in err and "\n" not in err, err
    assert not (workdir / "run").exists()


def test_an_id_without_its_version_is_still_resolved_by_gymnasium() -> None:
    """Only ids Gymnasium cannot find get the list of built-ins; an unversioned id is
    Gymnasium's to resolve (to its latest version, with its own warning)."""
    with pytest.warns(UserWarning, match="latest"):
        env = make_env("prefixgym/GuessNumber")
    assert env.spec is not None and env.spec.id == "prefixgym/GuessNumber-v0"


def test_installed_packages_register_envs_through_entry_points(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "pg_entry_point_envs.py").write_text(ENV_MODULE.replace(
        '"formtest/Countdown-v0" not in gym.registry', "False"))
    dist = tmp_path / "pg_entry_point_envs-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pg-entry-point-envs\n"
                                   "Version: 0.1\n")
    (dist / "entry_points.txt").write_text(
        "[prefixgym.envs]\nentrytest/Countdown-v0 = pg_entry_point_envs:Countdown\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        env = make_env("entrytest/Countdown-v0", {"start": 5})
        assert type(env.unwrapped).__name__ == "Countdown" and env.unwrapped.start == 5
    finally:
        gym.registry.pop("entrytest/Countdown-v0", None)


def test_a_shipped_recipe_is_used_by_name_and_flags_win(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "tools" in recipe_names()
    recipe = read_config_file(TrainConfig, config_path("tools"), FLAG_NAMES)
    out = workdir / "run"
    stages = '[{"steps": 1, "env_kwargs": {"expert_tool_rate": 1.0}}]'
    assert main(["train", "--config", "tools", "--out", str(out), "--sft-stages", stages,
                 *TINY_RUN]) == 0
    saved = json.loads((out / "config.json").read_text())
    assert saved["env"] == recipe["env"] and saved["env_kwargs"] == recipe["env_kwargs"]
    assert (saved["steps"], saved["sft_steps"], saved["max_tokens"]) == (1, 1, 4)
    assert saved["sft_lr_schedule"] == recipe["sft_lr_schedule"]
    assert saved["sft_stages"] == [{"steps": 1, "env_kwargs": {"expert_tool_rate": 1.0}}]
    # a stage whose env kwargs the env refuses stops the run before the model loads
    bad = '[{"steps": 1, "env_kwargs": {"expert_tool_rate": 2}}]'
    assert main(["train", "--config", "tools", "--out", str(workdir / "bad"),
                 "--sft-stages", bad, *TINY_RUN]) != 0
    err = capsys.readouterr().err
    assert "--sft-stages: stage 1:" in err and "expert_tool_rate must be" in err
    assert not (workdir / "bad" / "metrics.jsonl").exists()
    # a file of that name where the command runs wins over the recipe
    (workdir / "tools").write_text("steps = 3\n")
    assert config_path("tools") == "tools"
    with pytest.raises(SystemExit) as e:
        main(["train", "--config", "no-such-recipe"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "no config file 'no-such-recipe'" in err and "tools" in err


@pytest.mark.parametrize("name", recipe_names())
def test_every_shipped_recipe_is_a_valid_config_of_a_working_env(name: str) -> None:
    values = read_config_file(TrainConfig, config_path(name), FLAG_NAMES)
    config = TrainConfig(**values)
    env = make_env(config.env, config.env_kwargs)
    env.reset(seed=0)
    env.close()


def test_a_warm_start_without_an_expert_is_refused_before_the_model_loads(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "run"
    assert main(["train", "--env", "formtest_envs:Silent", "--out", str(out), *TINY_RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err == ("prefixgym train: --env formtest_envs:Silent has no scripted expert "
                   "(expert_action), whose episodes the warm start (--sft-steps 1) trains on; "
                   "pass --sft-steps 0 to train with GRPO alone")
    assert not (out / "config.json").exists()
    assert main(["train", "--env", "formtest_envs:Silent", "--out", str(out), *TINY_RUN,
                 "--sft-steps", "0"]) == 0


def test_a_runs_envs_are_all_closed(workdir: Path) -> None:
    assert main(["train", "--env", "formtest_envs:Tracked", "--out", str(workdir / "run"),
                 *TINY_RUN]) == 0
    import formtest_envs  # the module the run imported (from the working directory)

    assert formtest_envs.OPEN == set()


def test_env_errors_are_counted_apart_from_failures(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = workdir / "run"
    assert main(["train", "--env", "formtest_envs:Flaky", "--out", str(out), *TINY_RUN,
                 "--sft-steps", "0", "--eval-episodes", "4"]) == 0
    assert "2 of 4 episodes ended in env errors" in capsys.readouterr().err
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    [evaluation] = [r for r in lines if r["phase"] == "eval"]
    assert (evaluation["eval/episodes"], evaluation["eval/env_errors"]) == (2, 2)
    assert "session refused" in evaluation["eval/first_error"]
    report = (out / "report.md").read_text()
    assert "| env errors |" in report and "session refused: capacity reached" in report


def test_an_env_that_ignores_its_seed_is_refused_for_grpo(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["train", "--env", "formtest_envs:Unseeded", "--out", str(workdir / "run"),
                 *TINY_RUN]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prefixgym train: --env formtest_envs:Unseeded ignores its reset "
                          "seed") and "\n" not in err
