"""`prefixgym train --model DIR --lora-rank N`: a local HF checkpoint trains a LoRA
adapter that lands in OUT/adapter and loads back; a reasoning model's chat template
(not append-only: it strips earlier reasoning) is used turn by turn, with its switches,
and said; a template that cannot be used even so stops the run with the reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chat_templates import QWEN3_LIKE
from tiny_checkpoints import save_tiny_qwen2

from prefixgym.cli import main
from prefixgym.cli.train import build_run
from prefixgym.local_service import LocalService
from prefixgym.prompting import Conversation
from prefixgym.trainer.config import TrainConfig

SMALL = ["--env", "tests/Lengthy-v0", "--sft-steps", "1", "--sft-episodes-per-step", "2",
         "--groups-per-step", "2", "--group-size", "2", "--eval-episodes", "2", "--steps", "1",
         "--max-tokens", "4", "--no-progress"]
LAST_MESSAGE_ONLY = ("{% for m in messages %}{% if loop.last %}<|im_start|>{{ m.role }}\n"
                     "{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
                     "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_lora_run_on_a_local_checkpoint_writes_a_loadable_adapter(tmp_path: Path, capsys) -> None:
    save_tiny_qwen2(tmp_path / "ckpt")
    out = tmp_path / "run"
    argv = ["train", "--model", str(tmp_path / "ckpt"), "--lora-rank", "4",
            "--lora-targets", "attn,unembed", "--recompute-activations", "--out", str(out),
            *SMALL]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["recompute_activations"] is True
    err = capsys.readouterr().err
    assert "conversations use the built-in ChatML format" in err
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 32.0
    assert config["target_modules"] == ["k_proj", "lm_head", "o_proj", "q_proj", "v_proj"]
    with LocalService(str(tmp_path / "ckpt"), thread_tuning=False) as service:
        base = service.create_sampling_client().compute_logprobs([1, 2, 3, 4]).result()
        tuned = service.create_sampling_client(model_path=out / "adapter")
        assert tuned.compute_logprobs([1, 2, 3, 4]).result() != base


def test_a_template_that_is_not_append_only_stops_the_run(tmp_path: Path, capsys) -> None:
    save_tiny_qwen2(tmp_path / "ckpt", LAST_MESSAGE_ONLY)
    argv = ["train", "--model", str(tmp_path / "ckpt"), "--out", str(tmp_path / "run"), *SMALL]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "its chat template cannot be used: chat template is not append-only" in err


@pytest.mark.parametrize("switches", [None, '{"enable_thinking": false}'])
def test_a_reasoning_template_runs_turn_by_turn_and_says_so(tmp_path: Path, capsys,
                                                           switches: str | None) -> None:
    save_tiny_qwen2(tmp_path / "ckpt", QWEN3_LIKE)
    out = tmp_path / "run"
    argv = ["train", "--model", str(tmp_path / "ckpt"), "--out", str(out), *SMALL]
    if switches:
        argv += ["--chat-template-kwargs", switches]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "conversations use its tokenizer's chat template, token by token" in err
    assert "warning: the chat template is not append-only" in err and "PG101" in err
    assert ('with {"enable_thinking": false}' in err) == bool(switches)
    # the lint's verdict, at the run's switches
    verdict = (f"--model {tmp_path / 'ckpt'}: chat template: append_only=no at "
               + ('{"enable_thinking": false}' if switches else "the template's defaults"))
    assert verdict in err
    # a rollout of the run says the same, at the run's switches
    assert main(["rollout", "--run", str(out), "--groups", "1", "--group-size", "1",
                 "--max-tokens", "2"]) == 0
    assert verdict in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["chat_template_kwargs"] == (
        json.loads(switches) if switches else None)
    # the run's conversations carry the switch: with thinking off, every generation
    # prompt ends in the empty think block
    config = TrainConfig(model=str(tmp_path / "ckpt"), out=str(tmp_path / "again"),
                         chat_template_kwargs=json.loads(switches) if switches else None)
    run, service = build_run(config)
    conv = Conversation(service.tokenizer, system="S")
    conv.add_user("Hi.")
    text = service.tokenizer.decode(conv.generation_prompt().tokens)
    assert text.endswith("<think>\n\n</think>\n\n") == bool(switches)
    service.close()


@pytest.mark.parametrize("flags,message", [
    (["--lora-targets", "attn,embed"], "--lora-targets must be a comma-separated subset"),
    (["--lora-rank", "-1"], "--lora-rank must be >= 0"),
])
def test_bad_lora_flags_exit_2(flags: list[str], message: str, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["train", "--out", str(tmp_path), *flags])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_the_lint_fix_variant_of_a_reasoning_template_trains_as_append_only(
        tmp_path: Path, capsys) -> None:
    """`lint template --fix` writes a variant that keeps each reply as sampled; a run given
    it (`--chat-template`) builds prompts by appending, with no mismatch to warn of."""
    (tmp_path / "qwen.jinja").write_text(QWEN3_LIKE)
    fixed = tmp_path / "fixed.jinja"
    assert main(["lint", "template", str(tmp_path / "qwen.jinja"), "--eos-token", "<|im_end|>",
                 "--fix", str(fixed)]) == 0
    save_tiny_qwen2(tmp_path / "ckpt", QWEN3_LIKE)  # the checkpoint's own: not append-only
    capsys.readouterr()
    argv = ["train", "--model", str(tmp_path / "ckpt"), "--chat-template", str(fixed),
            "--out", str(tmp_path / "run"), *SMALL]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "conversations use its tokenizer's chat template\n" in err
    assert "chat template: append_only=yes at the template's defaults" in err
    assert "warning: the chat template" not in err
