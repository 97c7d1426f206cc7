"""The `prefixgym` command: dispatch, usage errors, and the demo's ledger."""

import re

from prefixgym.cli import main


def test_no_command_prints_usage_and_exits_2(capsys):
    assert main([]) == 2
    assert "train" in capsys.readouterr().out


def test_unknown_command(capsys):
    assert main(["nope"]) == 2
    assert "unknown command 'nope'" in capsys.readouterr().err


def test_demo_prints_a_ledger_with_cache_hits(capsys):
    assert main(["demo", "--turns", "3", "--samples", "2"]) == 0
    out = capsys.readouterr().out
    computed = int(re.search(r"prefill_computed_tokens\s+(\d+)", out).group(1))
    cached = int(re.search(r"prefill_cached_tokens\s+(\d+)", out).group(1))
    sampled = int(re.search(r"sampled_tokens\s+(\d+)", out).group(1))
    assert cached > 0 and computed > 0 and sampled > 0
    # per turn: computed + cached == the prompt length
    rows = re.findall(r"^\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s", out, re.M)
    assert len(rows) == 3
    for _, prompt, comp, cach, _ in rows:
        assert int(comp) + int(cach) == int(prompt)
    assert "extension property held: True" in out


def test_bench_lists_and_refuses_unknown(capsys):
    assert main(["bench"]) == 2
    assert "multiturn" in capsys.readouterr().out
    assert main(["bench", "nope"]) == 2
    assert "no benchmark 'nope'" in capsys.readouterr().err


def test_train_bad_env_or_model_exits_2_with_a_message(tmp_path, capsys):
    assert main(["train", "--out", str(tmp_path), "--env-kwargs", '{"bogus": 1}']) == 2
    assert "cannot make env 'prefixgym/GuessNumber-v0'" in capsys.readouterr().err
    assert main(["train", "--out", str(tmp_path), "--model", str(tmp_path / "none")]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_import_prefixgym_registers_the_envs_without_loading_torch():
    import subprocess
    import sys

    code = ("import sys, gymnasium as gym, prefixgym; "
            "gym.make('prefixgym/GuessNumber-v0'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


def test_train_help_and_usage_errors_answer_without_loading_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom prefixgym.cli import main\n"
            "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print('exit', e.code, 'torch' in sys.modules)")
    for argv, code_out in [(["--help"], 0), (["--lr", "-1"], 2), (["--config", "nope"], 2)]:
        out = subprocess.run([sys.executable, "-c", code, "train", *argv], capture_output=True,
                             text=True, check=True)
        assert out.stdout.strip().splitlines()[-1] == f"exit {code_out} False", out.stderr


def test_rollout_transcript_shows_what_the_env_added_before_each_reply():
    import io

    import gymnasium as gym

    from prefixgym.cli.rollout import print_group
    from prefixgym.prompting import Conversation
    from prefixgym.prompting.tokenizer import load_tokenizer
    from prefixgym.rollouts.expert import play_expert
    from prefixgym.rollouts.types import TrajectoryGroup

    tok = load_tokenizer()
    env = gym.make("prefixgym/Arithmetic-v0", num_operands=2, tool_schemas=False)
    traj = play_expert(env, tok, seed=4).trajectory
    system, tools = env.unwrapped.prompt()
    fixed = len(Conversation(tok, system=system, tools=tools).tokens)
    out = io.StringIO()
    print_group(TrajectoryGroup("g", 4, [traj]), out, decode=tok.decode, fixed_prefix=fixed)
    env_lines = [line for line in out.getvalue().splitlines() if line.startswith("    env: ")]
    question, result = env_lines
    assert f"What is {env.unwrapped._expression}?" in question and "Tools:" not in question
    assert f"\\n{env.unwrapped._answer}<|im_end|>" in result  # the calculator's reply
    assert "What is" not in result
    # without a decoder, the transcript is as before: no env lines
    plain = io.StringIO()
    print_group(TrajectoryGroup("g", 4, [traj]), plain)
    assert "env: " not in plain.getvalue() and plain.getvalue().count("assistant: ") == 2


def test_every_command_that_runs_a_model_takes_a_device(capsys, tmp_path, monkeypatch):
    """--device on train, rollout, serve and demo; "auto" is the test device here (cpu:
    tests/conftest.py) and says so in the first lines; a device torch cannot use is one
    line, exit 2."""
    import pytest
    import torch

    for command in ("train", "rollout", "serve", "demo"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        assert "--device" in capsys.readouterr().out, command
    assert main(["demo", "--turns", "1", "--samples", "1"]) == 0
    assert capsys.readouterr().out.startswith("model: tiny on cpu (")
    if not torch.cuda.is_available():
        assert main(["train", "--out", str(tmp_path), "--device", "cuda"]) == 2
        assert "device 'cuda' is not usable here" in capsys.readouterr().err
    from prefixgym.engine.device import resolve_device

    monkeypatch.setenv("PREFIXGYM_DEVICE", "meta")
    assert resolve_device("auto") == torch.device("meta")
    assert resolve_device("cpu") == torch.device("cpu")
