import pytest

from prefixgym.cli.flags import build_parser, parse_config
from prefixgym.cli.train_args import FLAG_NAMES
from prefixgym.trainer.config import TrainConfig


def test_flags_and_help_come_from_the_dataclass():
    parser = build_parser(TrainConfig, "t", "d", FLAG_NAMES)
    help_text = parser.format_help()
    for flag in ["--env", "--model", "--out", "--steps", "--sft-steps", "--group-size",
                 "--groups-per-step", "--lr", "--loss", "--async", "--resume", "--seed"]:
        assert flag in help_text
    assert "Episodes per group" in help_text


def test_parse_values():
    c = parse_config(TrainConfig, ["--steps", "3", "--async", "--lr", "0.01",
                                   "--env-kwargs", '{"high": 8}'], "t", "d", FLAG_NAMES)
    assert (c.steps, c.async_mode, c.lr, c.env_kwargs) == (3, True, 0.01, {"high": 8})
    # an unset `bool | None` is the config's to resolve; the flag pair sets it either way
    assert parse_config(TrainConfig, [], "t", "d", FLAG_NAMES).eval_on_start is False
    assert parse_config(TrainConfig, ["--eval-on-start"], "t", "d", FLAG_NAMES).eval_on_start


@pytest.mark.parametrize("argv", [["--loss", "nope"], ["--group-size", "1"], ["--lr", "-1"]])
def test_bad_values_are_usage_errors(argv, capsys):
    with pytest.raises(SystemExit) as e:
        parse_config(TrainConfig, argv, "t", "d", FLAG_NAMES)
    assert e.value.code == 2
    assert "must" in capsys.readouterr().err


def test_sampler_url_repeats_and_old_saved_strings_still_load(tmp_path):
    config = parse_config(TrainConfig, ["--sampler-url", "http://a/v1", "--sampler-url",
                                        "http://b/v1"], "t", "", FLAG_NAMES)
    assert config.sampler_url == ["http://a/v1", "http://b/v1"]
    assert parse_config(TrainConfig, [], "t", "", FLAG_NAMES).sampler_url == []
    assert TrainConfig(sampler_url="http://a/v1").sampler_url == ["http://a/v1"]  # type: ignore[arg-type]
    assert TrainConfig(sampler_url="").sampler_url == []  # type: ignore[arg-type]
    from prefixgym.cli.flags import read_config_file

    (tmp_path / "c.toml").write_text('sampler_url = ["http://a/v1"]\n')
    assert read_config_file(TrainConfig, str(tmp_path / "c.toml"))["sampler_url"] == ["http://a/v1"]
    (tmp_path / "one.toml").write_text('sampler_url = "http://a/v1"\n')
    assert read_config_file(TrainConfig, str(tmp_path / "one.toml"))["sampler_url"] == ["http://a/v1"]
    (tmp_path / "bad.toml").write_text('sampler_url = [1]\n')
    with pytest.raises(ValueError, match="list of strings"):
        read_config_file(TrainConfig, str(tmp_path / "bad.toml"))


def test_sft_stages_come_as_a_json_list_or_toml_tables(tmp_path, capsys):
    stages = [{"steps": 2, "env_kwargs": {"high": 8}}, {"steps": 1, "env_kwargs": {}}]
    config = parse_config(TrainConfig, ["--sft-steps", "3", "--sft-stages",
                                        '[{"steps": 2, "env_kwargs": {"high": 8}}, {"steps": 1}]'],
                          "t", "", FLAG_NAMES)
    assert config.sft_stages == stages
    from prefixgym.cli.flags import read_config_file

    (tmp_path / "c.toml").write_text('[[sft_stages]]\nsteps = 2\nenv_kwargs = { high = 8 }\n'
                                     '[[sft_stages]]\nsteps = 1\n')
    read = read_config_file(TrainConfig, str(tmp_path / "c.toml"))
    assert TrainConfig(sft_steps=3, **read).sft_stages == stages
    (tmp_path / "bad.toml").write_text('sft_stages = [1, 2]\n')
    with pytest.raises(ValueError, match="must be a list of tables"):
        read_config_file(TrainConfig, str(tmp_path / "bad.toml"))
    with pytest.raises(SystemExit):
        parse_config(TrainConfig, ["--sft-stages", '{"steps": 2}'], "t", "", FLAG_NAMES)
    assert "must be a JSON list of objects" in capsys.readouterr().err
