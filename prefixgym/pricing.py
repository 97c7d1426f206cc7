"""Money per phase: price tables (TOML) and what a count of tokens costs at one model's rates.

A table gives, per model name, the rate per million tokens of each phase the hosted
service bills: prefill computed, prefill served from the prefix cache, sample, train.
`prices.toml` in this package holds the service's published rates with the date and
source they were read from; a user's file (`--prices FILE.toml`, same shape) goes on
top, its rows replacing the shipped ones by name. `Prices.cost(...)` turns token
counts into a `Cost`, with what the same work would have cost without the prefix
cache and without shared prefixes (`Usage.cost` calls it). Knows numbers and TOML
files; nothing of runs, engines or `Usage`.
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

SHIPPED = Path(__file__).with_name("prices.toml")
REFERENCE_MODEL = "Qwen/Qwen3-8B"
"""The rates a run is priced at when neither --price-model nor --model names a row: a
small model the service trains, so that a built-in preset's tokens get a price too."""
PHASE_RATES = ("prefill", "prefill_cached", "sample", "train")
_FILE_KEYS = {"source", "currency", "prefill_cached_share", "models"}
PER_MILLION = 1_000_000


@dataclass(frozen=True)
class Prices:
    """One model's rates, in `currency` per million tokens."""

    model: str
    prefill: float
    prefill_cached: float
    sample: float
    train: float
    currency: str = "USD"
    source: str = ""

    def miss_cost(self, tokens: int) -> float:
        """What `tokens` prompt tokens cost prefilled, beyond what a cache hit costs."""
        return (self.prefill - self.prefill_cached) * tokens / PER_MILLION

    def cost(self, *, prefill_computed: int = 0, prefill_cached: int = 0, sampled: int = 0,
             train_computed: int = 0, train_shared: int = 0) -> Cost:
        """What these token counts cost per phase, and without the cache (every prompt
        token prefilled at the full rate) and without shared prefixes (every datum
        position trained)."""
        def at(rate: float, tokens: int) -> float:
            return rate * tokens / PER_MILLION

        prefill = at(self.prefill, prefill_computed)
        cached = at(self.prefill_cached, prefill_cached)
        sample = at(self.sample, sampled)
        train = at(self.train, train_computed)
        total = prefill + cached + sample + train
        return Cost(
            prices=self, prefill_computed=prefill, prefill_cached=cached, sample=sample,
            train=train,
            without_cache=total - prefill - cached + at(self.prefill,
                                                        prefill_computed + prefill_cached),
            without_shared_prefixes=total - train + at(self.train,
                                                       train_computed + train_shared))


@dataclass(frozen=True)
class Cost:
    """Money per phase of some tokens at `prices`, and two counterfactual totals."""

    prices: Prices
    prefill_computed: float
    prefill_cached: float
    sample: float
    train: float
    without_cache: float
    """The total had the prefix cache served nothing."""
    without_shared_prefixes: float
    """The total had training computed every datum's every position."""

    @property
    def total(self) -> float:
        return self.prefill_computed + self.prefill_cached + self.sample + self.train

    @property
    def without_either(self) -> float:
        return self.without_cache + self.without_shared_prefixes - self.total

    def to_json(self) -> dict[str, float | str]:
        return {"model": self.prices.model, "currency": self.prices.currency,
                "prefill_computed": self.prefill_computed, "prefill_cached": self.prefill_cached,
                "sample": self.sample, "train": self.train, "total": self.total,
                "without_cache": self.without_cache,
                "without_shared_prefixes": self.without_shared_prefixes}


def money(value: float, currency: str = "USD") -> str:
    """`value` to the cent, or to three significant digits below a dime ($0.000685)."""
    places = 2 if abs(value) >= 0.1 or value == 0 else 2 - math.floor(math.log10(abs(value)))
    digits = f"{value:,.{places}f}"
    if places > 2:
        digits = digits.rstrip("0")
    return f"${digits}" if currency == "USD" else f"{digits} {currency}"


def _rate(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value < 0:
        raise ValueError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def read_price_file(path: str | Path) -> dict[str, Prices]:
    """The rows of one price table file; ValueError naming the file and the key for
    anything it cannot use."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(f"{p}: no such price table") from None
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"{p}: cannot read the price table: {e}") from None
    unknown = set(data) - _FILE_KEYS
    if unknown:
        raise ValueError(f"{p}: unknown keys {sorted(unknown)}; a price table has "
                         f"{', '.join(sorted(_FILE_KEYS))}")
    source, currency = data.get("source", str(p)), data.get("currency", "USD")
    if not isinstance(source, str) or not isinstance(currency, str) or not currency:
        raise ValueError(f"{p}: source and currency must be strings")
    share = _rate(data.get("prefill_cached_share", 1.0), f"{p}: prefill_cached_share")
    models = data.get("models")
    if not isinstance(models, dict) or not models:
        raise ValueError(f'{p}: no [models."NAME"] tables with prefill, sample and train rates')
    rows = {}
    for name, row in models.items():
        where = f'{p}: [models."{name}"]'
        if not isinstance(row, dict):
            raise ValueError(f"{where} must be a table of rates")
        missing = {"prefill", "sample", "train"} - set(row)
        extra = set(row) - set(PHASE_RATES)
        if missing or extra:
            raise ValueError(f"{where} needs prefill, sample and train (and may give "
                             f"prefill_cached); {'missing ' + str(sorted(missing)) if missing else ''}"
                             f"{'unknown ' + str(sorted(extra)) if extra else ''}")
        rates = {k: _rate(row[k], f"{where}.{k}") for k in row}
        rates.setdefault("prefill_cached", rates["prefill"] * share)
        rows[name] = Prices(model=name, currency=currency, source=source, **rates)
    return rows


def price_table(*files: str | Path) -> dict[str, Prices]:
    """The shipped rates with each file's rows on top."""
    table = read_price_file(SHIPPED)
    for path in files:
        table.update(read_price_file(path))
    return table


def find_prices(table: dict[str, Prices], name: str) -> Prices | None:
    """The row `name` names: exactly, or by its last path part ignoring case
    (`Qwen3-8B` or a checkpoint directory `/models/qwen3-8b` finds `Qwen/Qwen3-8B`)."""
    if name in table:
        return table[name]
    short = Path(name.rstrip("/")).name.lower()
    found = [row for key, row in table.items()
             if key.lower() == name.lower() or key.rsplit("/", 1)[-1].lower() == short]
    return found[0] if len(found) == 1 else None


def run_prices(model: str, price_model: str = "", price_file: str = "") -> tuple[Prices, str]:
    """The rates a run's tokens are priced at, and a note saying why those: the row
    `price_model` names (ValueError when none does), else the one `model` names, else
    `REFERENCE_MODEL`'s."""
    table = price_table(*([price_file] if price_file else []))
    if price_model:
        prices = find_prices(table, price_model)
        if prices is None:
            raise ValueError(f"--price-model {price_model}: no such row in the price table; "
                             f"it has {', '.join(sorted(table))}")
        return prices, f"--price-model {price_model}"
    prices = find_prices(table, model)
    if prices is not None:
        return prices, f"the rates of --model {model}"
    return table[REFERENCE_MODEL], (
        f"the table has no row for --model {model}: what the same tokens would cost on "
        f"{REFERENCE_MODEL}; --price-model NAME picks another row")
