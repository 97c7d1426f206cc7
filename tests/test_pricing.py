"""Price tables and money per phase: the shipped rates, a user's file on top, the
arithmetic of `Usage.cost` and its counterfactuals, and one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixgym.cli import main as cli_main
from prefixgym.pricing import (
    REFERENCE_MODEL,
    Prices,
    find_prices,
    price_table,
    read_price_file,
    run_prices,
)
from prefixgym.types import Usage


def test_the_shipped_table_has_the_published_rates_and_a_cached_rate_at_a_fifth() -> None:
    table = price_table()
    qwen = table["Qwen/Qwen3-8B"]
    assert (qwen.prefill, qwen.sample, qwen.train) == (0.13, 0.40, 0.40)
    assert qwen.prefill_cached == pytest.approx(0.026)
    assert "2026" in qwen.source and qwen.currency == "USD"
    assert all(p.prefill_cached == pytest.approx(0.2 * p.prefill) for p in table.values())
    assert REFERENCE_MODEL in table


def test_usage_cost_prices_each_phase_and_the_work_sharing_saved() -> None:
    prices = Prices("m", prefill=2.0, prefill_cached=0.5, sample=4.0, train=8.0)
    usage = Usage(prefill_computed_tokens=1_000_000, prefill_cached_tokens=3_000_000,
                  sampled_tokens=250_000, train_computed_tokens=500_000,
                  train_shared_tokens=1_500_000, train_loss_tokens=100_000)
    cost = usage.cost(prices)
    assert (cost.prefill_computed, cost.prefill_cached, cost.sample, cost.train) == (
        2.0, 1.5, 1.0, 4.0)
    assert cost.total == 8.5
    assert cost.without_cache == 2.0 * 4 + 1.0 + 4.0  # every prompt token at the full rate
    assert cost.without_shared_prefixes == 2.0 + 1.5 + 1.0 + 8.0 * 2  # every datum position
    assert cost.without_either == 8.0 + 1.0 + 16.0
    assert Usage().cost(prices).total == 0
    assert cost.to_json()["total"] == 8.5 and cost.to_json()["model"] == "m"


def test_a_users_file_replaces_rows_by_name_and_adds_its_own(tmp_path: Path) -> None:
    path = tmp_path / "mine.toml"
    path.write_text('source = "our contract"\ncurrency = "EUR"\nprefill_cached_share = 0.5\n'
                    '[models."Qwen/Qwen3-8B"]\nprefill = 1\nsample = 2\ntrain = 3\n'
                    '[models."acme/Tiny"]\nprefill = 0.1\nsample = 0.2\ntrain = 0.3\n'
                    'prefill_cached = 0\n')
    table = price_table(path)
    assert table["Qwen/Qwen3-8B"] == Prices("Qwen/Qwen3-8B", 1.0, 0.5, 2.0, 3.0, "EUR",
                                            "our contract")
    assert table["acme/Tiny"].prefill_cached == 0.0
    assert table["openai/gpt-oss-20b"].currency == "USD"  # the shipped rows stay
    prices, note = run_prices("tiny", "acme/Tiny", str(path))
    assert prices.model == "acme/Tiny" and "--price-model acme/Tiny" in note


def test_a_model_finds_its_row_by_name_path_or_short_name() -> None:
    table = price_table()
    assert find_prices(table, "openai/gpt-oss-20b").model == "openai/gpt-oss-20b"
    assert find_prices(table, "qwen3-8b").model == "Qwen/Qwen3-8B"
    assert find_prices(table, "/models/Qwen3-8B/").model == "Qwen/Qwen3-8B"
    assert find_prices(table, "tiny") is None
    both = {**table, "other/Qwen3-8B": table["Qwen/Qwen3-8B"]}
    assert find_prices(both, "Qwen3-8B") is None  # two rows end so: neither is guessed
    prices, note = run_prices("tiny")
    assert prices.model == REFERENCE_MODEL and "no row for --model tiny" in note
    prices, note = run_prices("/ckpt/gpt-oss-20b")
    assert prices.model == "openai/gpt-oss-20b" and note == "the rates of --model /ckpt/gpt-oss-20b"


@pytest.mark.parametrize(("text", "error"), [
    ("models = 3", "no [models"),
    ("colour = 1\n[models.a]\nprefill = 1\nsample = 1\ntrain = 1", "unknown keys ['colour']"),
    ('[models.a]\nprefill = 1\nsample = 1', "missing ['train']"),
    ('[models.a]\nprefill = 1\nsample = 1\ntrain = 1\ndecode = 2', "unknown ['decode']"),
    ('[models.a]\nprefill = -1\nsample = 1\ntrain = 1', "[models.\"a\"].prefill must be a "
     "non-negative number, got -1"),
    ('[models.a]\nprefill = true\nsample = 1\ntrain = 1', "got True"),
    ('[models.a]\nprefill = nan\nsample = 1\ntrain = 1', "got nan"),
    ("prefill_cached_share = 'half'\n[models.a]\nprefill = 1\nsample = 1\ntrain = 1",
     "prefill_cached_share must be"),
    ("[models", "cannot read the price table"),
])
def test_a_bad_price_file_is_one_line_naming_the_file_and_key(tmp_path: Path, text: str,
                                                              error: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(text)
    with pytest.raises(ValueError) as e:
        read_price_file(path)
    assert str(e.value).startswith(f"{path}: ") and error in str(e.value)
    assert "\n" not in str(e.value)


def test_train_refuses_a_bad_price_or_trace_flag_before_the_model_loads(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert cli_main(["train", "--out", str(out), "--prices", str(tmp_path / "no.toml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"prefixgym train: {tmp_path / 'no.toml'}: no such price table")
    assert cli_main(["train", "--out", str(out), "--price-model", "acme/Nothing"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("prefixgym train: --price-model acme/Nothing: no such row in the "
                          "price table; it has ") and "Qwen/Qwen3-8B" in err
    assert not (out / "config.json").exists()
    assert cli_main(["train", "--out", str(out), "--trace", str(tmp_path / "no" / "t.jsonl")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"prefixgym train: --trace {tmp_path / 'no' / 't.jsonl'}: cannot write it: "
        "No such file or directory")
