"""`prefixgym train --agent FILE.py:fn --tasks FILE.jsonl`: an agent program over the
`openai` client trains the built-in model as an env does: its multi-turn calls hit the
prefix cache, its steps train, two runs of one config log the same numbers, and a run
killed after a checkpoint resumes as the uninterrupted one went on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import prefixgym.trainer.run as run_module  # noqa: E402
from prefixgym.cli import main  # noqa: E402
from prefixgym.cli.train import train  # noqa: E402
from prefixgym.trainer.config import TrainConfig  # noqa: E402

PROGRAM = '''
from openai import OpenAI

def agent(base_url, api_key, model, task):
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    messages = [{"role": "system", "content": "Answer briefly."},
                {"role": "user", "content": task["question"]}]
    firsts = []
    for turn in range(2):
        reply = client.chat.completions.create(model=model, messages=messages)
        message = reply.choices[0].message
        firsts.append(reply.choices[0].token_ids[0])
        messages += [{"role": "assistant", "content": message.content},
                     {"role": "user", "content": "Once more."}]
    return {"odd": float(sum(firsts) % 2)}
'''


class Killed(Exception):
    pass


def write_agent(tmp_path: Path) -> tuple[str, str]:
    (tmp_path / "agent.py").write_text(PROGRAM)
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("".join(json.dumps({"question": f"What is {i} + {i}?"}) + "\n"
                             for i in range(5)))
    return f"{tmp_path / 'agent.py'}:agent", str(tasks)


def config(tmp_path: Path, out: str, **more) -> TrainConfig:
    agent, tasks = write_agent(tmp_path)
    return TrainConfig(**{"agent": agent, "tasks": tasks, "sft_steps": 0, "groups_per_step": 2,
                          "group_size": 4, "eval_episodes": 3, "eval_every": 2, "max_tokens": 8,
                          "progress": False, "out": str(tmp_path / out), **more})


def lines(out: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(x).items() if not k.startswith("time/")}
            for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_an_agent_run_trains_and_repeats_and_resumes_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    train(config(tmp_path, "a", steps=3, checkpoint_every=2, seed=1))
    a = lines(tmp_path / "a")
    grpo = [r for r in a if r["phase"] == "grpo"]
    assert [r["step"] for r in grpo] == [0, 1, 2]
    assert all(r["tokens/prefill_cached"] > 0 for r in grpo)  # turn 2 extends turn 1
    assert sum(r["datums/count"] for r in grpo) > 0 and any(r["tokens/train_computed"] for r in grpo)
    assert all(r["episodes/failed"] == 0 for r in grpo)
    assert [r["eval/episodes"] for r in a if r["phase"] == "eval"] == [3.0, 3.0]
    assert "prefixgym train: " + str(tmp_path / "agent.py") in (tmp_path / "a" / "report.md").read_text()

    save = run_module.save_checkpoint

    def save_then_die(out, training, state, *args, **kwargs):
        path = save(out, training, state, *args, **kwargs)
        if state.next_step == 2:
            raise Killed
        return path

    with monkeypatch.context() as patch:
        patch.setattr(run_module, "save_checkpoint", save_then_die)
        with pytest.raises(Killed):
            train(config(tmp_path, "c", steps=3, checkpoint_every=2, seed=1))
    train(config(tmp_path, "c", steps=3, checkpoint_every=2, seed=1, resume=True))
    assert lines(tmp_path / "c") == a


def test_a_failing_program_is_counted_and_training_goes_on(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    (tmp_path / "flaky.py").write_text(PROGRAM + '''
def flaky(base_url, api_key, model, task):
    if task["question"].startswith("What is 1 "):
        raise RuntimeError("tool server down")
    return agent(base_url, api_key, model, task)
''')
    _, tasks = write_agent(tmp_path)
    train(TrainConfig(agent=f"{tmp_path / 'flaky.py'}:flaky", tasks=tasks, sft_steps=0,
                      groups_per_step=5,
                      group_size=2, eval_episodes=2, steps=1, max_tokens=4, progress=False,
                      out=str(tmp_path / "run")))
    [step] = [r for r in lines(tmp_path / "run") if r["phase"] == "grpo"]
    assert step["episodes/failed"] == 2
    assert step["episodes/first_error"].endswith(
        "the program raised RuntimeError: tool server down")
    assert "step 0: 2 episodes failed (first: " in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--agent", "{agent}"], "--agent needs --tasks FILE.jsonl"),
    (["--agent", "{agent}", "--tasks", "{tasks}", "--sft-steps", "3"], "or --sft-steps 0"),
    (["--agent", "{dir}/agent.py:nope", "--tasks", "{tasks}"], "agent.py has no 'nope'"),
    (["--agent", "{agent}", "--tasks", "{dir}/missing.jsonl"], "missing.jsonl: No such file"),
    (["--tasks", "{tasks}"], "--tasks and --eval-tasks go with --agent"),
])
def test_bad_agent_flags_get_one_line(tmp_path, capsys, argv, message):
    agent, tasks = write_agent(tmp_path)
    argv = [a.format(agent=agent, tasks=tasks, dir=tmp_path) for a in argv]
    try:
        code = main(["train", *argv, "--out", str(tmp_path / "run"), "--no-progress"])
    except SystemExit as e:  # a usage error: argparse's exit
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_the_python_api_takes_the_program_and_tasks_as_objects(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    seen = []

    def program(base_url, api_key, model, task):
        import openai

        client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
        reply = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": task}])
        seen.append(task)
        return float(reply.choices[0].token_ids[0] % 2)

    result = train(TrainConfig(sft_steps=0, steps=1, groups_per_step=2, group_size=2,
                               eval_episodes=2, max_tokens=4, progress=False,
                               out=str(tmp_path / "run")),
                   agent=program, tasks=(f"task {i}" for i in range(3)),
                   eval_tasks=["held out"])
    assert len(set(seen)) == 3 and "held out" in seen  # two training tasks, one held out
    assert [e["eval/episodes"] for e in result.evals] == [1.0]
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["agent"].endswith("program")


def write_records(path: Path, tokenizer, count: int = 3) -> list[int]:
    """Records as `prefixgym proxy --record` writes them: an expert's answer to each task;
    returns each record's sampled-token count."""
    from prefixgym.prompting import Conversation

    sampled = []
    with path.open("w") as f:
        for i in range(count):
            conv = Conversation(tokenizer, system="Answer briefly.")
            conv.add_user(f"What is {i} + {i}?")
            conv.generation_prompt()
            reply = conv.encode_reply(str(2 * i))
            conv.add_sampled(reply)
            seg = next(s for s in conv.segments if s.kind == "reply")
            mask = [seg.start <= k < seg.end for k in range(len(conv.tokens))]
            f.write(json.dumps({"session": f"s{i}", "sequence": 0, "branch": 0,
                                "tokens": conv.tokens, "sampled_mask": mask,
                                "logprobs": [0.0] * len(mask), "branch_notes": [],
                                "turns": [{"reply_start": seg.start, "reply_end": seg.end,
                                           "stop_reason": "stop"}]}) + "\n")
            sampled.append(seg.end - seg.start)
    return sampled


def test_an_agent_run_warms_up_on_recorded_expert_runs(tmp_path, monkeypatch):
    from prefixgym.prompting.tokenizer import load_tokenizer

    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    sampled = write_records(tmp_path / "expert.jsonl", load_tokenizer())
    train(config(tmp_path, "run", steps=1, sft_data=str(tmp_path / "expert.jsonl"),
                 sft_steps=3, sft_episodes_per_step=2, sft_lr_schedule="constant"))
    sft = [r for r in lines(tmp_path / "run") if r["phase"] == "sft"]
    assert [r["sft_step"] for r in sft] == [0, 1, 2]
    # each step imitates two records' replies: their sampled tokens are the loss
    assert all(r["tokens/train_loss"] in {a + b for a in sampled for b in sampled} for r in sft)
    assert sft[-1]["sft/loss"] < sft[0]["sft/loss"]


@pytest.mark.parametrize("line, message", [
    ('{"tokens": [1, 2, 99999], "sampled_mask": [false, true, true], "turns": '
     '[{"reply_start": 1, "reply_end": 3}]}', "token id 99999 is outside this model's vocabulary"),
    ('{"tokens": [1, 2]}', "not a recorded sequence"),
])
def test_a_bad_record_file_is_one_line_before_training(tmp_path, capsys, line, message):
    agent, tasks = write_agent(tmp_path)
    (tmp_path / "bad.jsonl").write_text(line + "\n")
    code = main(["train", "--agent", agent, "--tasks", tasks, "--sft-data",
                 str(tmp_path / "bad.jsonl"), "--sft-steps", "2", "--out", str(tmp_path / "run"),
                 "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "bad.jsonl:1" in err and "Traceback" not in err


ENV_PROGRAM = '''
from openai import OpenAI
from prefixgym.envs.registration import make_agent_env

def agent(base_url, api_key, model, task):
    """Plays the env's task through the API and lets the env grade the reply."""
    assert set(task) == {"env", "env_kwargs", "seed", "system", "tools", "messages"}
    client = OpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    reply = client.chat.completions.create(model=model, messages=[
        {"role": "system", "content": task["system"]}, *task["messages"]])
    env = make_agent_env(task["env"], task["env_kwargs"])
    env.reset(seed=task["seed"])
    _, reward, _, _, info = env.step(reply.choices[0].message.content)
    env.close()
    return {"env": float(reward), "success": float(info["is_success"])}
'''


def test_tasks_can_come_from_an_envs_reset(tmp_path, monkeypatch):
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    (tmp_path / "env_agent.py").write_text(ENV_PROGRAM)
    assert main(["train", "--agent", f"{tmp_path / 'env_agent.py'}:agent", "--tasks", "env",
                 "--env", "prefixgym/Arithmetic-v0", "--env-kwargs",
                 '{"num_operands": 2, "tool_schemas": false}', "--steps", "1",
                 "--groups-per-step", "2", "--group-size", "2", "--eval-episodes", "3",
                 "--max-tokens", "4", "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    records = lines(tmp_path / "run")
    [step] = [r for r in records if r["phase"] == "grpo"]
    assert step["episodes/failed"] == 0, step.get("episodes/first_error")
    [evaluation] = [r for r in records if r["phase"] == "eval"]
    assert evaluation["eval/episodes"] == 3 and evaluation["eval/env_errors"] == 0


def test_trace_records_every_call_of_an_agent_run(tmp_path, monkeypatch, capsys):
    """--trace gets each call as an env's turn: its episode and group, its call number;
    a second call's prompt extends the first call's prompt and reply, token for token;
    and `prefixgym lint trace` reads the file."""
    monkeypatch.setattr(run_module, "write_plots", lambda out, records: [])
    trace = tmp_path / "trace.jsonl"
    train(config(tmp_path, "run", steps=1, trace=str(trace)))
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    grpo = [r for r in records if r["group_id"].startswith("step0.")]
    assert len(grpo) == 2 * 4 * 2  # groups x G x the program's two calls
    by_episode: dict[str, dict[int, dict]] = {}
    for r in grpo:
        by_episode.setdefault(r["episode_id"], {})[r["turn"]] = r
    assert len(by_episode) == 8 and all(sorted(t) == [0, 1] for t in by_episode.values())
    for turns in by_episode.values():
        first, second = turns[0], turns[1]
        assert first["num_samples"] == 1 and len(first["completion_tokens"]) == 1
        sent = first["prompt_tokens"] + first["completion_tokens"][0]
        assert second["prompt_tokens"][:len(sent)] == sent
        assert second["usage"]["prefill_cached_tokens"] > 0
    capsys.readouterr()
    assert main(["lint", "trace", str(trace)]) in (0, 1)
    assert f"{len(records)} requests" in capsys.readouterr().out
