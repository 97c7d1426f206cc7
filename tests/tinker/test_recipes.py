"""tinker-cookbook's recipes on the local engine, with `tinker.ServiceClient` swapped for
`prefixgym.tinker.ServiceClient` and nothing else changed but what offline use forces:
a local dataset (`datasets.load_dataset`), the local tokenizer, and a renderer for a
model name the cookbook's table does not know. Each runs a few steps on the tiny
preset, saves, and resumes from its last checkpoint in a second run.

The recipes train LoRA adapters (`create_lora_training_client`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

# "tinker.types", not "tinker": without the SDK, this folder itself (tests/tinker/)
# imports as a namespace package called tinker
pytest.importorskip("tinker.types")
import tinker  # noqa: E402

chz = pytest.importorskip("chz")
pytest.importorskip("tinker_cookbook")
datasets = pytest.importorskip("datasets")

from prefixgym.local_service import LocalService  # noqa: E402
from prefixgym.tinker import ServiceClient  # noqa: E402

GSM8K = [{"question": f"What is {a} plus {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
         for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 2), (9, 1), (4, 4), (6, 3)]]
DEEPMATH = [{"question": f"What is {a} times {b}?", "final_answer": str(a * b)}
            for a, b in [(2, 3), (4, 5), (6, 7), (8, 9), (3, 3), (5, 5), (7, 2), (9, 1)]]
POLARIS = [{"problem": row["question"], "answer": row["final_answer"]} for row in DEEPMATH]
OPENTHOUGHTS = [{"conversations": [{"from": "human", "value": f"Count to {n}."},
                                   {"from": "gpt", "value": " ".join(map(str, range(1, n + 1)))}]}
                for n in range(1, 9)]
SCIKNOWEVAL = [{"domain": "Chemistry", "details": {"level": "L3"}, "type": "mcq-4-choices",
                "question": f"Which is heavier, {a} g or {b} g?",
                "choices": {"label": ["A", "B"], "text": [f"{a} g", f"{b} g"]},
                "answerKey": "A" if a > b else "B"}
               for a, b in [(3, 1), (1, 4), (5, 9), (8, 2), (6, 7), (9, 3), (2, 5), (7, 1),
                            (4, 6), (9, 8)]]
FEEDBACK = [{"orig_instruction": f"Name a number near {n}.", "orig_criteria": "Is it near?",
             **{f"orig_score{i}_description": f"{i}: this near" for i in range(1, 6)},
             "orig_reference_answer": str(n + 1)} for n in range(8)]
HHH = [{"chosen": f"\n\nHuman: Name a number near {n}.\n\nAssistant: {n + 1}.",
        "rejected": f"\n\nHuman: Name a number near {n}.\n\nAssistant: A word."}
       for n in range(8)]
CHATS = [{"messages": [{"role": "user", "content": f"Name a number near {n}."},
                       {"role": "assistant", "content": f"{n + 1} is near {n}."}]}
         for n in range(8)]


class Rows:
    """The few `datasets.Dataset` methods the recipes call, on a list of rows (an
    in-memory `Dataset` needs its fingerprint hashing, broken with the installed pyarrow)."""

    def __init__(self, rows: list[dict[str, Any]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Any:
        return iter(self.rows)

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, int):
            return self.rows[key]
        return [row[key] for row in self.rows]

    def select(self, indices: Any) -> Rows:
        return Rows([self.rows[i] for i in indices])

    def to_list(self) -> list[dict[str, Any]]:
        return list(self.rows)

    def take(self, n: int) -> Rows:
        return Rows(self.rows[:n])

    def shuffle(self, seed: int = 0, buffer_size: int | None = None) -> Rows:
        return Rows(self.rows[seed % len(self.rows):] + self.rows[:seed % len(self.rows)])

    def batch(self, batch_size: int, drop_last_batch: bool = False) -> Batches:
        """As a streamed `IterableDataset.batch`: column dicts of `batch_size` rows."""
        return Batches(self.rows, batch_size, drop_last_batch)


class Batches:
    def __init__(self, rows: list[dict[str, Any]], size: int, drop_last: bool) -> None:
        cut = len(rows) - len(rows) % size if drop_last else len(rows)
        self.batches = [{k: [r[k] for r in rows[i:i + size]] for k in rows[0]}
                        for i in range(0, cut, size)]

    def __iter__(self) -> Any:
        return iter(self.batches)

    def set_epoch(self, seed: int) -> None:
        return None


@pytest.fixture
def offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The one swap (ServiceClient), and what offline use forces, in every cookbook module
    that imported the names: the dataset, the tokenizer, the renderer."""
    import tinker_cookbook.distillation.datasets
    import tinker_cookbook.recipes.chat_sl.chat_datasets
    import tinker_cookbook.recipes.distillation.off_policy_reasoning
    import tinker_cookbook.recipes.distillation.on_policy_distillation
    import tinker_cookbook.recipes.distillation.on_policy_multi_teacher
    import tinker_cookbook.recipes.forecasting.train
    import tinker_cookbook.recipes.math_rl.arithmetic_env
    import tinker_cookbook.recipes.math_rl.math_env
    import tinker_cookbook.recipes.math_rl.train
    import tinker_cookbook.recipes.multiplayer_rl.guess_number.env
    import tinker_cookbook.recipes.multiplayer_rl.guess_number.train
    import tinker_cookbook.recipes.multiplayer_rl.text_arena.env
    import tinker_cookbook.recipes.multiplayer_rl.text_arena.train
    import tinker_cookbook.recipes.preference.dpo.train
    import tinker_cookbook.recipes.preference.shorter.env
    import tinker_cookbook.recipes.preference.shorter.train
    import tinker_cookbook.recipes.prompt_distillation.train
    import tinker_cookbook.recipes.rl_basic
    import tinker_cookbook.recipes.rl_loop
    import tinker_cookbook.recipes.rubric.data
    import tinker_cookbook.recipes.rubric.env
    import tinker_cookbook.recipes.rubric.prometheus_experimental
    import tinker_cookbook.recipes.rubric.train
    import tinker_cookbook.recipes.sdft.datasets
    import tinker_cookbook.recipes.sdft.train
    import tinker_cookbook.recipes.sl_basic
    import tinker_cookbook.recipes.sl_loop  # noqa: F401
    from tinker_cookbook import model_info, tokenizer_utils

    monkeypatch.setattr(tinker, "ServiceClient", ServiceClient)
    monkeypatch.setenv("PREFIXGYM_TINKER_DIR", str(tmp_path / "service"))
    tokenizer = LocalService(model="tiny").tokenizer

    def load_dataset(path: str, *args: object, split: str | None = None,
                     **kwargs: object) -> Any:
        rows = (GSM8K if "gsm8k" in path else HHH if "hh-rlhf" in path
                else DEEPMATH if "DeepMath" in path else POLARIS if "Polaris" in path
                else OPENTHOUGHTS if "OpenThoughts" in path
                else SCIKNOWEVAL if "SciKnowEval" in path
                else FEEDBACK if "Feedback-Collection" in path else CHATS)
        # (SciKnowEval ships one split, "test", which the recipe splits itself)
        splits = {"train": Rows(rows),
                  "test": Rows(rows if rows is SCIKNOWEVAL else rows[:2])}
        return splits[split] if split else datasets.DatasetDict(splits)

    replacements = {
        datasets.load_dataset: load_dataset,
        tokenizer_utils.get_tokenizer: lambda name: tokenizer,
        model_info.get_recommended_renderer_name: lambda name: "role_colon",
    }
    for module in [m for name, m in sys.modules.items() if name.startswith("tinker_cookbook")]:
        for attr, value in list(vars(module).items()):
            if callable(value) and value in replacements:
                monkeypatch.setattr(module, attr, replacements[value])
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    return {"tokenizer": tokenizer}


def _checkpoints(log_path: Path) -> list[dict[str, Any]]:
    lines = (log_path / "checkpoints.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def _interrupt_after_first_checkpoint(log_path: Path) -> None:
    """As if the run had stopped after its first checkpoint: keep only that record."""
    path = log_path / "checkpoints.jsonl"
    path.write_text(path.read_text().splitlines()[0] + "\n")


@pytest.mark.parametrize("loss_fn", ["stable_reinforce", "gspo"])
def test_rl_loop_runs_saves_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, loss_fn: str) -> None:
    from tinker_cookbook.recipes import rl_loop

    log_path = tmp_path / "rl"
    config = rl_loop.Config(log_path=str(log_path), model_name="tiny", batch_size=2,
                            group_size=4, max_tokens=12, lora_rank=4, save_every=1,
                            max_steps=2, loss_fn=loss_fn, learning_rate=1e-3)
    rl_loop.main(config)
    assert [c["name"] for c in _checkpoints(log_path)] == ["000001", "final"]
    _interrupt_after_first_checkpoint(log_path)
    rl_loop.main(chz.replace(config, max_steps=3))  # resumes at batch 1, from its state
    assert [m["progress/batch"] for m in _metrics(log_path)] == [0, 1, 1, 2]


def test_sl_loop_runs_saves_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.recipes import sl_loop

    log_path = tmp_path / "sl"
    config = sl_loop.Config(log_path=str(log_path), model_name="tiny", batch_size=2,
                            max_length=256, lora_rank=4, save_every=1, max_steps=3,
                            learning_rate=1e-3)
    sl_loop.main(config)
    assert [c["name"] for c in _checkpoints(log_path)] == ["000001", "000002", "final"]
    first = [m["train_mean_nll"] for m in _metrics(log_path)]
    _interrupt_after_first_checkpoint(log_path)
    sl_loop.main(config)  # resumes at batch 1 with the saved weights and optimizer
    again = [m["train_mean_nll"] for m in _metrics(log_path)][3:]
    assert len(again) == 2 and again == pytest.approx(first[1:], rel=1e-4)


def _renderer_of(state_path: str) -> str | None:
    """What a resumed recipe reads back from the run a checkpoint belongs to (through
    `create_rest_client`), from a new ServiceClient on the same checkpoint root."""
    from tinker_cookbook import checkpoint_utils

    with ServiceClient() as client:
        return checkpoint_utils.get_renderer_name_from_checkpoint(client, state_path)


def test_sl_basic_runs_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.recipes import sl_basic
    from tinker_cookbook.recipes.chat_sl.chat_datasets import NoRobotsBuilder

    config = sl_basic.build_config_blueprint("tiny").make()
    common = chz.replace(config.dataset_builder.common_config, batch_size=2, max_length=256,
                         renderer_name="role_colon")
    log_path = tmp_path / "sl_basic"
    config = chz.replace(config, log_path=str(log_path), lora_rank=4, eval_every=0,
                         save_every=1, renderer_name="role_colon",
                         dataset_builder=NoRobotsBuilder(common_config=common))
    sl_basic.main(config)
    records = _checkpoints(log_path)
    assert [c["name"] for c in records] == ["000001", "000002", "000003", "final"]
    assert records[0]["state_path"].startswith("tinker://")
    assert _renderer_of(records[0]["state_path"]) == "role_colon"
    # The supervised loop saves the state it names after batch k once batch k's update
    # (and, pipelined, the next one's) was submitted, and resumes at batch k: a resumed
    # run repeats those batches (as on the service, if it keeps a session's requests in
    # order) and cannot equal the first.
    # What holds: it resumes at the checkpoint's batch, from its state, reproducibly.
    monkeypatch.setattr("builtins.input", lambda prompt: "resume")  # the recipe asks
    resumed = []
    for _ in range(2):
        _interrupt_after_first_checkpoint(log_path)
        done = len(_metrics(log_path))
        sl_basic.main(config)
        resumed.append([m["train_mean_nll"] for m in _metrics(log_path)[done:]])
    assert len(resumed[0]) == 3 and resumed[0] == resumed[1]  # batches 1-3, twice alike


def test_rl_basic_runs_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.recipes import rl_basic
    from tinker_cookbook.recipes.math_rl.math_env import Gsm8kDatasetBuilder

    config = rl_basic.build_config_blueprint("tiny").make()
    builder = Gsm8kDatasetBuilder(batch_size=2, group_size=4, renderer_name="role_colon",
                                  model_name_for_tokenizer="tiny")
    log_path = tmp_path / "rl_basic"
    config = chz.replace(config, log_path=str(log_path), lora_rank=4, max_tokens=12,
                         save_every=1, max_steps=2, dataset_builder=builder,
                         renderer_name="role_colon")
    rl_basic.main(config)
    records = _checkpoints(log_path)
    assert records[-1]["name"] == "final"
    assert _renderer_of(records[0]["state_path"]) == "role_colon"
    _interrupt_after_first_checkpoint(log_path)
    monkeypatch.setattr("builtins.input", lambda prompt: "resume")  # the recipe asks
    rl_basic.main(chz.replace(config, max_steps=3))
    batches = [m["progress/batch"] for m in _metrics(log_path) if "progress/batch" in m]
    assert batches[-2:] == [1, 2]  # resumed at batch 1, from its state


def _batches(log_path: Path) -> list[int]:
    return [m["progress/batch"] for m in _metrics(log_path) if "progress/batch" in m]


def _async_cli_resumes(cli_main: Callable[[Any], Any], cli: Any, log_path: Path) -> None:
    """`_rl_run_resumes` for a recipe whose `cli_main(cli)` is a coroutine function."""
    import asyncio

    _rl_run_resumes(lambda steps: asyncio.run(cli_main(chz.replace(cli, max_steps=steps))),
                    log_path)


def _save_every_batch(monkeypatch: pytest.MonkeyPatch, trainer: Any) -> None:
    """For a recipe whose command line has no save_every: its trainer's `main` gets the
    config the recipe built with `save_every=1` (and a small LoRA rank) set on it."""
    main = trainer.main
    monkeypatch.setattr(trainer, "main", lambda config: main(chz.replace(
        config, save_every=1, lora_rank=4)))


def _supervised_run_resumes(run: Callable[[], None], log_path: Path) -> None:
    """`run()` trains from scratch, saving every batch; cut back to its first checkpoint,
    `run()` again resumes there: it trains the batches from it on (see sl_basic)."""
    run()
    records = _checkpoints(log_path)
    assert records[-1]["name"] == "final" and len(records) >= 3
    assert _renderer_of(records[0]["state_path"]) == "role_colon"
    first = len(_metrics(log_path))
    _interrupt_after_first_checkpoint(log_path)
    run()
    assert len(_metrics(log_path)) - first == first - 1


def _rl_run_resumes(run: Callable[[int], None], log_path: Path) -> None:
    """`run(max_steps)` trains, saving every batch; cut back to its first checkpoint, a
    longer run resumes at batch 1 from its state."""
    run(2)
    records = _checkpoints(log_path)
    assert records[-1]["name"] == "final"
    assert _renderer_of(records[0]["state_path"]) == "role_colon"
    _interrupt_after_first_checkpoint(log_path)
    run(3)
    assert _batches(log_path)[-2:] == [1, 2]


@pytest.mark.parametrize("env", ["arithmetic", "gsm8k", "polaris", "deepmath"])
def test_math_rl_runs_and_resumes(offline: dict[str, Any], tmp_path: Path, env: str) -> None:

    from tinker_cookbook.recipes.math_rl import train as math_rl

    log_path = tmp_path / "math_rl"
    cli = math_rl.CLIConfig(model_name="tiny", lora_rank=4, renderer_name="role_colon",
                            env=env, group_size=2, groups_per_batch=2, max_tokens=5,
                            eval_every=0, save_every=1, max_steps=2, log_path=str(log_path),
                            behavior_if_log_dir_exists="resume")
    _async_cli_resumes(math_rl.cli_main, cli, log_path)


def test_multiplayer_guess_number_runs_and_resumes(offline: dict[str, Any],
                                                   tmp_path: Path) -> None:
    import asyncio

    from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess
    from tinker_cookbook.rl import train as rl_train

    def run(cli: Any) -> None:  # what the recipe's `__main__` does, but the prompt
        asyncio.run(rl_train.main(chz.replace(guess.build_config(cli), lora_rank=4)))

    log_path = tmp_path / "guess_number"
    cli = guess.CLIConfig(model_name="tiny", renderer_name="role_colon", group_size=2,
                          batch_size=2, max_tokens=6, eval_every=0, save_every=1,
                          max_steps=2, log_path=str(log_path))
    _rl_run_resumes(lambda steps: run(chz.replace(cli, max_steps=steps)), log_path)


def test_chat_sl_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:
    from tinker_cookbook.recipes.chat_sl import train as chat_sl

    log_path = tmp_path / "chat_sl"
    cli = chat_sl.CLIConfig(log_path=str(log_path), model_name="tiny", dataset="no_robots",
                            lora_rank=4, save_every=1, eval_every=0, infrequent_eval_every=0,
                            renderer_name="role_colon", max_length=256, batch_size=2,
                            behavior_if_log_dir_exists="resume")
    _supervised_run_resumes(lambda: chat_sl.cli_main(cli), log_path)


def test_dpo_runs_and_resumes(offline: dict[str, Any], tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.preference import train_dpo
    from tinker_cookbook.recipes.preference.dpo import train as dpo

    _save_every_batch(monkeypatch, train_dpo)
    log_path = tmp_path / "dpo"
    cli = dpo.CLIConfig(model_name="tiny", dataset="hhh", renderer_name="role_colon",
                        batch_size=2, max_length=256, log_path=str(log_path), max_steps=3,
                        behavior_if_log_dir_exists="resume")
    _supervised_run_resumes(lambda: dpo.cli_main(cli), log_path)


def test_prompt_distillation_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:
    import tinker_cookbook
    from tinker_cookbook.recipes.prompt_distillation import train as distill

    shipped = Path(tinker_cookbook.__file__).parent / "example_data" / "conversations.jsonl"
    log_path = tmp_path / "prompt_distillation"
    cli = distill.CLIConfig(file_path=str(shipped), log_path=str(log_path), model_name="tiny",
                            num_epochs=1, lora_rank=4, save_every=1, eval_every=0,
                            renderer_name="role_colon", max_length=256, batch_size=32,
                            behavior_if_log_dir_exists="resume", max_steps=3)
    _supervised_run_resumes(lambda: distill.cli_main(cli), log_path)


def test_preference_shorter_runs_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.recipes.preference.shorter import train as shorter
    from tinker_cookbook.rl import train as rl_train

    _save_every_batch(monkeypatch, rl_train)
    log_path = tmp_path / "shorter"
    cli = shorter.CLIConfig(model_name="tiny", renderer_name="role_colon", batch_size=2,
                            group_size=2, max_tokens=6, eval_every=0, log_path=str(log_path),
                            behavior_if_log_dir_exists="resume", max_steps=2)
    _rl_run_resumes(lambda steps: shorter.cli_main(chz.replace(cli, max_steps=steps)),
                    log_path)


def test_multiplayer_text_arena_runs_and_resumes(offline: dict[str, Any],
                                                 tmp_path: Path) -> None:
    pytest.importorskip("textarena")
    import asyncio

    from tinker_cookbook.recipes.multiplayer_rl.text_arena import train as arena
    from tinker_cookbook.rl import train as rl_train

    def run(cli: Any) -> None:  # what the recipe's `__main__` does, but the prompt
        asyncio.run(rl_train.main(chz.replace(arena.build_config(cli), lora_rank=4)))

    log_path = tmp_path / "text_arena"
    cli = arena.CLIConfig(model_name="tiny", renderer_name="role_colon", test_opponent="random",
                          batch_size=2, num_train_datapoints=8, num_test_datapoints=2,
                          max_tokens=6, eval_every=0, save_every=1, max_steps=2,
                          log_path=str(log_path))
    _rl_run_resumes(lambda steps: run(chz.replace(cli, max_steps=steps)), log_path)


def test_on_policy_distillation_runs_and_resumes(offline: dict[str, Any],
                                                 tmp_path: Path) -> None:

    from tinker_cookbook.recipes.distillation import on_policy_distillation as distill

    log_path = tmp_path / "on_policy_distillation"
    cli = distill.CLIConfig(model_name="tiny", lora_rank=4, renderer_name="role_colon",
                            teacher_model="tiny", dataset="deepmath", group_size=2,
                            groups_per_batch=2, max_tokens=6, eval_every=0, save_every=1,
                            max_steps=2, log_path=str(log_path),
                            behavior_if_log_dir_exists="resume")
    _async_cli_resumes(distill.cli_main, cli, log_path)



def test_on_policy_multi_teacher_runs_and_resumes(offline: dict[str, Any],
                                                  tmp_path: Path) -> None:

    from tinker_cookbook.recipes.distillation import on_policy_multi_teacher as multi

    log_path = tmp_path / "on_policy_multi_teacher"
    cli = multi.CLIConfig(model_name="tiny", lora_rank=4, renderer_name="role_colon",
                          deepmath_teacher_model="tiny", tulu3_teacher_model="tiny",
                          deepmath_groups_per_batch=1, tulu3_groups_per_batch=1, group_size=2,
                          max_tokens=6, eval_every=0, save_every=1, log_path=str(log_path),
                          behavior_if_log_dir_exists="resume")
    _async_cli_resumes(multi.cli_main, cli, log_path)


def test_off_policy_reasoning_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:
    from tinker_cookbook.recipes.distillation import off_policy_reasoning as reasoning

    log_path = tmp_path / "off_policy_reasoning"
    cli = reasoning.CLIConfig(model_name="tiny", lora_rank=4, renderer_name="role_colon",
                              batch_size=2, max_length=256, buffer_size=8, max_prompts=8,
                              eval_every=0, save_every=1, log_path=str(log_path),
                              behavior_if_log_dir_exists="resume")
    _supervised_run_resumes(lambda: reasoning.cli_main(cli), log_path)


def test_rlhf_pipeline_runs_its_three_stages_and_resumes(offline: dict[str, Any], tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    from tinker_cookbook.recipes.preference.rlhf import rlhf_pipeline as rlhf

    monkeypatch.setenv("TINKER_COOKBOOK_RUNS_DIR", str(tmp_path / "runs"))
    cli = rlhf.CLIConfig(base_model="tiny", short_name="tiny", lora_rank=4, max_length=256,
                         batch_size=2, rl_max_tokens=6, rl_group_size=2, save_every=1,
                         eval_every=0, max_steps=2)
    rlhf.cli_main(cli)
    root = next((tmp_path / "runs").glob("rlhf-tiny*"))
    for stage in ("sft", "rm", "rl"):  # the RL stage loads the SFT state and the RM weights
        assert _checkpoints(root / stage)[-1]["name"] == "final", stage
    _interrupt_after_first_checkpoint(root / "rl")  # the RL stage alone, resumed
    rlhf.cli_main(chz.replace(cli, run_sft=False, run_rm=False, max_steps=3))
    assert _batches(root / "rl")[-2:] == [1, 2]


def _forecasting_csv(path: Path) -> Path:
    """Prophet-Arena-shaped rows: eight events closing before 2025-06-01 (training), four
    opening after it (validation), one binary market each."""
    import csv

    fields = ["submission_id", "event_ticker", "title", "snapshot_time", "close_time",
              "market_outcome", "category", "markets", "sources"]
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for i in range(12):
            month = 1 + i % 4 if i < 8 else 7 + i % 4
            writer.writerow({
                "submission_id": f"s{i}", "event_ticker": f"E{i}", "title": f"Event {i}",
                "snapshot_time": f"2025-{month:02d}-01T00:00:00Z",
                "close_time": f"2025-{month:02d}-20T00:00:00Z",
                "market_outcome": json.dumps({f"Team {i} wins": i % 2}), "category": "Sports",
                "markets": json.dumps([f"Team {i} wins"]),
                "sources": json.dumps([{"title": "Preview", "summary": f"Team {i} is fit."}])})
    return path


def test_forecasting_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:

    from tinker_cookbook.recipes.forecasting import train as forecasting

    log_path = tmp_path / "forecasting"
    cli = forecasting.Config(model_name="tiny", renderer_name="role_colon", lora_rank=4,
                             data_path=str(_forecasting_csv(tmp_path / "events.csv")),
                             split_date="2025-06-01", group_size=2, groups_per_batch=2,
                             validation_group_size=1, max_tokens=6, eval_every=0,
                             save_every=1, log_path=str(log_path),
                             behavior_if_log_dir_exists="resume")
    _async_cli_resumes(forecasting.cli_main, cli, log_path)


def test_sdft_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:

    from tinker_cookbook.recipes.sdft import train as sdft

    log_path = tmp_path / "sdft"
    # topk=0: the top-k teacher targets are (N, K) loss inputs, not supported here yet
    cli = sdft.CLIConfig(model_name="tiny", lora_rank=4, renderer_name="role_colon",
                         dataset="sciknoweval", groups_per_batch=2, max_tokens=6, topk=0,
                         max_context_length=1024, eval_every=0, save_every=1,
                         log_path=str(log_path), behavior_if_log_dir_exists="resume")
    _async_cli_resumes(sdft.cli_main, cli, log_path)


def _long_context_checkpoint(directory: Path) -> str:
    """A small Qwen2 checkpoint with a 4,096-token context and the built-in tokenizer:
    for recipes that sample more tokens than the presets' 2,048-token context holds."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from prefixgym.prompting.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("builtin")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=len(tokenizer), max_position_embeddings=4096,
        tie_word_embeddings=True))
    model.save_pretrained(directory, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    return str(directory)


def test_rubric_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:

    from tinker_cookbook.recipes.rubric import generate_data
    from tinker_cookbook.recipes.rubric import train as rubric

    # its grader samples up to 2,048 tokens (hard-coded): a model with a longer context
    model = _long_context_checkpoint(tmp_path / "model")
    train_path, test_path = generate_data.generate_dataset(8, 2, seed=0,
                                                           write_dir=str(tmp_path))
    log_path = tmp_path / "rubric"
    cli = rubric.CLIConfig(model_name=model, lora_rank=4, renderer_name="role_colon",
                           grader_llm_name=model, grader_renderer_name="role_colon",
                           train_jsonl_path=train_path, test_jsonl_path=test_path,
                           train_group_size=2, groups_per_batch=1, max_tokens=6,
                           eval_every=0, save_every=1, log_path=str(log_path),
                           behavior_if_log_dir_exists="resume")
    _async_cli_resumes(rubric.cli_main, cli, log_path)


def test_rubric_prometheus_runs_and_resumes(offline: dict[str, Any], tmp_path: Path) -> None:

    from tinker_cookbook.recipes.rubric import prometheus_experimental as prometheus

    model = _long_context_checkpoint(tmp_path / "model")  # (as rubric's grader)
    log_path = tmp_path / "prometheus"
    cli = prometheus.CLIConfig(model_name=model, lora_rank=4, renderer_name="role_colon",
                               grader_llm_name=model, grader_renderer_name="role_colon",
                               train_group_size=2, groups_per_batch=1, max_tokens=6,
                               eval_every=0, save_every=1, log_path=str(log_path),
                               behavior_if_log_dir_exists="resume")
    _async_cli_resumes(prometheus.cli_main, cli, log_path)
