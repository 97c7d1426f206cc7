"""`prefixgym lint` end to end: exit codes, JSON shape, text output, options, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import lint_templates as T
import pytest

from prefixgym.cli.lint import main
from prefixgym.pricing import money, price_table


@pytest.fixture(autouse=True)
def _isolated_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # pyproject defaults are read from the cwd upward: keep the repo's out of these tests
    monkeypatch.chdir(tmp_path)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def run_json(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    code = main(argv + ["--format", "json"])
    return code, json.loads(capsys.readouterr().out)


def test_clean_jinja_file_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "chatml.jinja", T.CHATML)
    code, out = run_json(["template", str(path), "--eos-token", "<|im_end|>"], capsys)
    assert code == 0
    assert out["target"] == str(path) and out["append_only"] is True and out["findings"] == []


def test_json_shape_of_a_finding(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "qwen.jinja", T.STRIPS_THINK)
    code, out = run_json(["template", str(path), "--eos-token", "<|im_end|>"], capsys)
    assert code == 1
    assert out["append_only"] is False
    (finding,) = out["findings"]
    assert {"rule", "severity", "message", "location", "first_divergence"} <= set(finding)
    assert finding["rule"] == "PG101" and finding["severity"] == "error"
    assert isinstance(finding["first_divergence"], int)


def test_text_output_shows_caret_under_divergence(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "ws.jinja", T.WHITESPACE_CHANGES)
    assert main(["template", str(path), "--eos-token", "<|im_end|>"]) == 1
    out = capsys.readouterr().out
    assert "\033[" not in out  # not a TTY: no colour
    lines = out.splitlines()
    actual = next(i for i, line in enumerate(lines) if line.lstrip().startswith("actual:"))
    caret_col = lines[actual + 1].index("^")
    assert lines[actual][caret_col : caret_col + 2] == "\\n"  # the extra newline, escaped
    assert "PG105" in out and "1 finding(s)" in out


def test_tokenizer_config_with_named_templates_and_tokens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = {"chat_template": [{"name": "tool_use", "template": T.STRIPS_THINK},
                                {"name": "default", "template": T.CHATML}],
              "eos_token": {"content": "<|im_end|>"}, "bos_token": None}
    path = write(tmp_path / "tokenizer_config.json", json.dumps(config))
    code, out = run_json(["template", str(path)], capsys)
    assert code == 0 and out["findings"] == []


def test_model_directory_reads_chat_template_jinja(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "tokenizer_config.json", json.dumps({"eos_token": "<|endoftext|>"}))
    write(tmp_path / "chat_template.jinja", T.EOS_IN_HISTORY)
    code, out = run_json(["template", str(tmp_path)], capsys)
    assert code == 1 and [f["rule"] for f in out["findings"]] == ["PG104"]


def test_select_and_ignore(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "date.jinja", T.READS_DATE)
    base = ["template", str(path), "--eos-token", "<|im_end|>"]
    assert run_json(base + ["--ignore", "PG108"], capsys)[0] == 0
    assert run_json(base + ["--ignore", "PG10"], capsys)[0] == 0
    code, out = run_json(base + ["--select", "PG2,PG3"], capsys)
    assert code == 0 and out["findings"] == []
    code, out = run_json(base + ["--select", "PG1"], capsys)
    # a warning is reported, but a lint whose findings are warnings only exits 0
    assert code == 0 and [f["rule"] for f in out["findings"]] == ["PG108"]


def test_pyproject_defaults_apply_and_cli_wins(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "pyproject.toml", '[tool.prefixgym.lint]\nignore = ["PG101"]\n')
    path = write(tmp_path / "qwen.jinja", T.STRIPS_THINK)
    assert main(["template", str(path), "--eos-token", "<|im_end|>"]) == 0
    assert main(["template", str(path), "--eos-token", "<|im_end|>", "--ignore", "PG109"]) == 1
    capsys.readouterr()


def test_bad_pyproject_value_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write(tmp_path / "pyproject.toml", '[tool.prefixgym.lint]\nblock-size = "big"\n')
    path = write(tmp_path / "ok.jinja", T.CHATML)
    assert main(["template", str(path)]) == 2
    assert "block-size must be an integer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["template", "missing.jinja"], "missing.jinja: no such file"),
        (["trace", "missing.jsonl"], "missing.jsonl: no such file"),
        (["template", "bad.jinja"], "bad.jinja:1: template does not compile"),
        (["trace", "bad.jsonl"], "bad.jsonl:2: invalid JSON"),
        (["trace", "fields.jsonl"], "fields.jsonl:1: 'prompt_tokens' must be a list of integer token ids"),
        (["template", "ok.jinja", "--select", "XX9"], "unknown rule code"),
        (["trace", "fields.jsonl", "--block-size", "0"], "block-size must be a positive integer"),
        (["template", "ok.jinja", "--prices", "none.toml"], "none.toml: no such price table"),
        (["template", "ok.jinja", "--price-model", "acme/X"], "--price-model acme/X: no such row"),
    ],
)
def test_bad_input_exits_2_with_one_clear_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    write(tmp_path / "bad.jinja", "{% for m in messages %}{{ m.content }")
    write(tmp_path / "ok.jinja", T.CHATML)
    write(tmp_path / "bad.jsonl", '{"prompt_tokens": [1, 2]}\n{"prompt_tokens": [1, 2\n')
    write(tmp_path / "fields.jsonl", '{"prompt_tokens": "1 2 3"}\n')
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_module_entry_point_runs_as_a_subprocess(tmp_path: Path) -> None:
    path = write(tmp_path / "qwen.jinja", T.STRIPS_THINK)
    proc = subprocess.run(
        [sys.executable, "-m", "prefixgym", "lint", "template", str(path),
         "--eos-token", "<|im_end|>", "--format", "json"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )
    assert proc.returncode == 1, proc.stderr
    assert json.loads(proc.stdout)["findings"][0]["rule"] == "PG101"


def _builtin_trace(path: Path, retokenize: bool) -> None:
    from prefixgym.prompting.tokenizer import load_tokenizer

    tok = load_tokenizer("builtin")

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    system = "<|im_start|>system\nYou play a guessing game.<|im_end|>\n"
    first = enc(system + "<|im_start|>user\nGuess a number between 1 and 16.<|im_end|>\n<|im_start|>assistant\n")
    reply = "I think the hidden number is eight, so: 8"
    sampled = [i for ch in reply for i in enc(ch)] + enc("<|im_end|>")  # one id per character
    rest = "\n<|im_start|>user\nHigher.<|im_end|>\n<|im_start|>assistant\n"
    if retokenize:
        second = enc(tok.decode(first + sampled) + rest)
    else:
        second = first + sampled + enc(rest)
    lines = [{"episode_id": 0, "group_id": 0, "turn": 0, "prompt_tokens": first,
              "completion_tokens": [sampled], "num_samples": 1, "include_prompt_logprobs": False,
              "usage": {"prefill_cached_tokens": 0, "prefill_computed_tokens": len(first)}},
             {"episode_id": 0, "group_id": 0, "turn": 1, "prompt_tokens": second,
              "completion_tokens": [enc("12<|im_end|>")], "num_samples": 1,
              "include_prompt_logprobs": False}]
    write(path, "\n".join(json.dumps(obj) for obj in lines) + "\n")


def test_trace_retokenized_history_decoded_with_builtin_tokenizer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.jsonl"
    _builtin_trace(path, retokenize=False)
    code, out = run_json(["trace", str(path), "--block-size", "4"], capsys)
    assert code == 0 and out["findings"] == [] and out["append_only"] is True
    assert out["observed_hit_rate"] == 0.0 and out["predicted_hit_rate"] > 0.3
    _builtin_trace(path, retokenize=True)
    code, out = run_json(["trace", str(path), "--block-size", "4"], capsys)
    assert code == 1
    (finding,) = out["findings"]
    assert finding["rule"] == "PG201" and finding["location"].endswith(":2: episode 0, turn 1")
    assert "hidden number" in finding["expected"] and "hidden number" in finding["actual"]
    assert main(["trace", str(path), "--block-size", "4"]) == 1
    text = capsys.readouterr().out
    assert "predicted hit rate" in text and "PG201 error [retokenized-history]" in text
    # what it costs: the tokens it makes prefill again, and with a price table, money
    tokens = finding["reprefilled_tokens"]
    assert tokens == finding["missed_tokens"] > 0 and "reprefill_money" not in finding
    assert out["reprefilled_tokens_by_rule"] == {"PG201": tokens}
    assert f"  cost: {tokens:,} tokens prefilled again over the trace" in text
    assert f"tokens prefilled again, by rule: PG201 {tokens:,}" in text
    code, out = run_json(["trace", str(path), "--block-size", "4", "--price-model",
                          "gpt-oss-20b"], capsys)
    prices = price_table()["openai/gpt-oss-20b"]
    cost = (prices.prefill - prices.prefill_cached) * tokens / 1e6
    assert out["findings"][0]["reprefill_money"] == (
        f"{money(cost)} beyond cache hits at openai/gpt-oss-20b's rates")


def test_trace_block_size_from_pyproject(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    _builtin_trace(path, retokenize=True)
    write(tmp_path / "pyproject.toml", "[tool.prefixgym.lint]\nblock-size = 4096\n")
    code, out = run_json(["trace", str(path)], capsys)
    assert out["block_size"] == 4096
    assert code == 0 and out["append_only"] is False  # the miss is within one block: not reported


def test_strict_keeps_an_edge_whitespace_pg112_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "trims.jinja", T.TRIMS_REPLY)
    code, out = run_json(["template", str(path), "--eos-token", "<|im_end|>"], capsys)
    assert code == 0 and out["append_only"] is True  # a finding, graded a warning
    assert [(f["rule"], f["severity"]) for f in out["findings"]] == [("PG112", "warning")]
    code, out = run_json(["template", str(path), "--eos-token", "<|im_end|>", "--strict"], capsys)
    assert code == 1 and out["append_only"] is False
    assert [(f["rule"], f["severity"]) for f in out["findings"]] == [("PG112", "error")]


def test_verdict_at_the_settings_given_with_each_switch_beside_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from chat_templates import GRANITE_LIKE

    path = write(tmp_path / "granite.jinja", GRANITE_LIKE)
    base = ["template", str(path), "--eos-token", "<|end_of_text|>"]
    # at its defaults: append-only; a date warning; `controls` set breaks it, beside the verdict
    code, out = run_json(base, capsys)
    assert code == 0 and out["append_only"] is True and out["settings"] == {}
    assert [f["rule"] for f in out["findings"]] == ["PG108"]
    (switch,) = out["switches"]
    assert (switch["switch"], switch["value"], switch["rule"], switch["name"]) == (
        "controls", True, "PG107", "history-rewritten")
    assert switch["reprefilled_chars_per_turn"] > 0
    assert out["content_shape"]["user"] == "strings"
    assert main(base) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith(f"{path}: append_only=yes at the template's defaults, ")
    assert "content written as plain strings" in lines[0]
    assert lines[1].startswith("switch controls=True breaks the prefix: PG107 error")
    assert "characters prefilled again per turn" in lines[1]
    # at the run's settings, with the switch set: the verdict is no, and the exit code 1
    code, out = run_json(base + ["--template-kwargs", '{"controls": {"length": "short"}}'], capsys)
    assert code == 1 and out["append_only"] is False
    assert out["settings"] == {"controls": {"length": "short"}} and out["switches"] == []
    assert [f["rule"] for f in out["findings"]] == ["PG107", "PG108"]
    # --select / --ignore apply to switch lines too
    assert run_json(base + ["--ignore", "PG107"], capsys)[1]["switches"] == []
    assert main(base + ["--template-kwargs", "[1]"]) == 2
    assert "must be a JSON object" in capsys.readouterr().err


def test_a_template_that_renders_no_probe_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "raises.jinja", "{{ raise_exception('nope') }}")
    code, out = run_json(["template", str(path)], capsys)
    assert code == 1 and out["append_only"] is False
    assert {f["severity"] for f in out["findings"]} == {"warning"}  # PG109s: nothing checked
