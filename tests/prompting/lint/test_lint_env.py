"""`lint env`: expert episodes through the Conversation builder, checked like a trace."""

from __future__ import annotations

import gymnasium as gym
import pytest

from prefixgym.cli.lint import lint_env, main
from prefixgym.envs.guess_number import GuessNumber
from prefixgym.prompting import Conversation
from prefixgym.prompting.findings import LintInputError
from prefixgym.prompting.lint.env import lint_conversations
from prefixgym.prompting.tokenizer import load_tokenizer


class _SessionGuessNumber(GuessNumber):
    """Puts a per-episode session number in the system prompt: a varying fixed prefix."""

    def _reset_task(self) -> str:
        self.system_prompt = f"Session {int(self.np_random.integers(1000, 9999))}. " + GuessNumber.system_prompt
        return super()._reset_task()


gym.register(id="prefixgym-test/SessionGuessNumber-v0", entry_point=_SessionGuessNumber)


def test_builtin_env_is_clean(capsys: pytest.CaptureFixture[str]) -> None:
    report = lint_env("prefixgym/GuessNumber-v0", episodes=2)
    assert report.findings == []
    assert report.append_only and report.episodes == 2
    assert report.trace.predicted_hit_rate > 0.3  # later turns reuse earlier prompts
    assert main(["env", "prefixgym/GuessNumber-v0", "--episodes", "2"]) == 0
    assert "no findings" in capsys.readouterr().out


def test_fixed_prefix_varying_across_seeds_fires_pg301() -> None:
    report = lint_env("prefixgym-test/SessionGuessNumber-v0", episodes=2)
    rules = {f.rule for f in report.findings}
    assert "PG301" in rules
    assert "PG302" not in rules
    pg301 = next(f for f in report.findings if f.rule == "PG301")
    assert pg301.first_divergence is not None and pg301.first_divergence > 0


def test_history_edited_after_a_reply_fires_pg302() -> None:
    tok = load_tokenizer()
    conv = Conversation(tok, system="Guess.")
    conv.add_user("A number?")
    prompt = conv.generation_prompt()
    conv.add_sampled(conv.encode_reply("8"), stop_reason="stop")
    assert conv.extension_ok
    conv._tokens[len(conv.fixed_prefix) + 1] += 1  # a builder that rewrites history
    conv.add_user("Lower.")
    conv.generation_prompt()
    report = lint_conversations("edited", [("seed 0", conv)])
    assert not report.append_only
    pg302 = [f for f in report.findings if f.rule == "PG302"]
    assert pg302 and pg302[0].first_divergence == len(conv.fixed_prefix) + 1 < prompt.length


def test_unknown_env_is_bad_input() -> None:
    with pytest.raises(LintInputError, match="cannot make env 'nope/Nothing-v0'"):
        lint_env("nope/Nothing-v0")
