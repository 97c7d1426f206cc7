"""`prefixgym lint template|trace|env ...`: parse arguments, run one check, print, exit.

Exit codes: 0 no error (findings, if any, are warnings), 1 an error (for a template:
the verdict at the settings given is append_only=no, or another error such as PG106),
2 bad input (one clear line on stderr, no traceback). A template's switch values that
would break the prefix are reported beside its verdict and do not change the exit
code; with `--fix OUT.jinja` for a template that is not append-only, the exit code is 0
once an append-only variant is written, 1 when none can be (`prompting.templates.fix`). Defaults come from `[tool.prefixgym.lint]` in the nearest pyproject.toml;
command-line options win. `lint env` plays the env's expert here
(`rollouts.expert`) and hands the conversations to `prompting.lint.env`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from prefixgym.cli.errors import error_line
from prefixgym.cli.flags import json_object
from prefixgym.pricing import Prices, money, run_prices
from prefixgym.prompting.findings import Finding, LintInputError, filter_findings, parse_codes
from prefixgym.prompting.lint.cache_sim import DEFAULT_BLOCK_SIZE
from prefixgym.prompting.lint.config import LintConfig, load_config
from prefixgym.prompting.lint.report import (
    Report,
    render_text,
    switch_line,
    verdict_line,
)
from prefixgym.types import JSONObject

if TYPE_CHECKING:  # transformers loads only for the checks that need a tokenizer
    from transformers import PreTrainedTokenizerBase

    from prefixgym.prompting.lint.env import EnvReport
    from prefixgym.prompting.lint.source import TemplateSource
    from prefixgym.prompting.lint.trace_file import TraceRequest
    from prefixgym.prompting.templates.append_only import TemplateReport
    from prefixgym.prompting.templates.fix import TemplateFix


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="prefixgym lint", description="Find what makes prompts miss the prefix cache."
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--format", choices=["text", "json"], default="text", help="output format")
    common.add_argument("--select", help="comma-separated rule codes or prefixes to report (e.g. PG1,PG203)")
    common.add_argument("--ignore", help="comma-separated rule codes or prefixes to leave out")
    common.add_argument("--prices", metavar="FILE.toml", help="a price table on top of the "
                        "shipped one (docs/files.md): price what each finding costs")
    common.add_argument("--price-model", metavar="NAME", help="the price table's row to price "
                        "findings at (given --prices alone: Qwen/Qwen3-8B)")
    sub = parser.add_subparsers(dest="what", required=True)

    template = sub.add_parser("template", parents=[common], help="probe a chat template")
    template.add_argument("path", help="a .jinja file, a tokenizer_config.json or a model directory")
    template.add_argument("--bos-token", help="BOS string, when the file does not say")
    template.add_argument("--eos-token", help="EOS (end of generation) string, when the file does not say")
    template.add_argument("--tokenizer", help="a local tokenizer directory: also compare token ids")
    template.add_argument("--strict", action="store_true",
                          help="PG112 (the template trims whitespace at a reply's edges) stays an "
                               "error and makes append_only no, even when only such replies break")
    template.add_argument("--template-kwargs", "--chat-template-kwargs", type=json_object,
                          default={}, metavar="JSON", dest="template_kwargs",
                          help="the template's switches as the run passes them (train's "
                               "--chat-template-kwargs), e.g. '{\"enable_thinking\": false}': "
                               "append_only is the verdict at these settings (default: the "
                               "template's defaults); every other switch value that breaks the "
                               "prefix is a line of its own beside it")
    template.add_argument("--fix", metavar="OUT.jinja",
                          help="where the template is not append-only at these settings, write "
                               "a variant that is (each reply in the history as it was sampled, "
                               "everything else as the template renders it) to OUT.jinja, lint "
                               "it again and show the diff; or say why no such variant can be "
                               "written. Exit 0 once a variant is written, 1 when refused; "
                               "train --chat-template OUT.jinja uses it")

    trace = sub.add_parser("trace", parents=[common], help="replay a rollout trace (JSONL)")
    trace.add_argument("path", help="trace file, one sampling request per line")
    trace.add_argument("--block-size", type=int, help="tokens per simulated cache block")
    trace.add_argument("--capacity-tokens", type=int, help="tokens the simulated cache holds")
    trace.add_argument("--tokenizer", help="a local tokenizer directory to decode tokens "
                       "(default: the built-in tokenizer, else token ids)")

    env = sub.add_parser("env", parents=[common], help="lint an env's conversations (expert policy)")
    env.add_argument("env_id", metavar="ENV", help="the env: a registered id such as "
                     "prefixgym/GuessNumber-v0, module:id, module:Class or path/to/file.py:Class")
    env.add_argument("--env-kwargs", type=json_object, default={},
                     help="keyword arguments for the env, as a JSON object")
    env.add_argument("--episodes", type=int, default=3, help="expert episodes to run")
    env.add_argument("--block-size", type=int, help="tokens per simulated cache block")
    env.add_argument("--tokenizer", help="a local tokenizer directory (default: built-in)")
    return parser


def load_tokenizer_dir(path: str) -> PreTrainedTokenizerBase:
    """A transformers tokenizer from a local directory (never running its code), or
    LintInputError."""
    from prefixgym.prompting.tokenizer import load_tokenizer_dir as load

    try:
        return load(path)
    except ValueError as exc:
        raise LintInputError(str(exc)) from None


def _builtin_tokenizer() -> PreTrainedTokenizerBase:
    from prefixgym.prompting.tokenizer import load_tokenizer

    return load_tokenizer("builtin")


def _decoder(
    tokenizer: PreTrainedTokenizerBase | None, requests: list[TraceRequest]
) -> Callable[[list[int]], str] | None:
    if tokenizer is None:
        return None
    size = len(tokenizer)
    for r in requests:
        if any(t >= size for t in r.prompt_tokens) or any(t >= size for c in r.completion_tokens for t in c):
            return None  # the trace was not made with this tokenizer: show ids

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False))

    return decode


def _run(args: argparse.Namespace, config: LintConfig) -> Report:
    if args.what == "template":
        from prefixgym.prompting.lint.source import load_template
        from prefixgym.prompting.templates.append_only import probe_template

        source = load_template(args.path, args.bos_token, args.eos_token)
        tokenizer = load_tokenizer_dir(args.tokenizer) if args.tokenizer else None
        report = probe_template(source.template, source.bos_token, source.eos_token, tokenizer,
                                source.origin, strict=args.strict,
                                template_kwargs=args.template_kwargs)
        if args.fix:
            args.fixed = fix(source, report, args.fix, args.strict)
        return report
    if args.what == "trace":
        from prefixgym.prompting.lint.trace import analyze_trace
        from prefixgym.prompting.lint.trace_file import load_trace

        requests = load_trace(args.path)
        tokenizer = load_tokenizer_dir(args.tokenizer) if args.tokenizer else _builtin_tokenizer()
        return analyze_trace(requests, config.block_size, config.capacity_tokens,
                             _decoder(tokenizer, requests), args.path)
    tokenizer = load_tokenizer_dir(args.tokenizer) if args.tokenizer else None
    return lint_env(args.env_id, episodes=args.episodes, block_size=config.block_size,
                    tokenizer=tokenizer, env_kwargs=args.env_kwargs)


def fix(source: TemplateSource, report: TemplateReport, out: str, strict: bool) -> TemplateFix:
    """`--fix OUT`: the variant written to `out` (when there is one) and its lint."""
    from prefixgym.prompting.templates.fix import fix_template

    fixed = fix_template(source.template, report, source.bos_token, source.eos_token,
                         origin=out, strict=strict)
    if fixed.variant is not None:
        try:
            with open(out, "w", encoding="utf-8") as f:
                f.write(fixed.variant)
        except OSError as e:
            raise LintInputError(f"--fix {out}: cannot write it: {e.strerror or e}") from None
    return fixed


def fix_lines(fixed: TemplateFix, out: str) -> list[str]:
    """What `--fix` says after the report: the diff and the variant's verdict, or why not."""
    if fixed.variant is None:
        if fixed.report is not None and fixed.report.append_only:
            return ["", f"--fix: nothing to fix: {fixed.refused}"]
        return ["", f"--fix: no variant written: {fixed.refused}"]
    assert fixed.report is not None
    lines = ["", fixed.diff.rstrip("\n"), "",
             f"--fix: wrote {out}: {verdict_line(fixed.report)} (use it with train "
             f"--chat-template {out})"]
    lines += [f"--fix: {switch_line(f)}" for f in fixed.report.switches]
    return lines


def lint_env(env_id: str, episodes: int = 3, block_size: int = DEFAULT_BLOCK_SIZE,
             tokenizer: PreTrainedTokenizerBase | None = None,
             env_kwargs: JSONObject | None = None) -> EnvReport:
    """Play `episodes` expert episodes of `env_id` (seeds 0..n-1) and lint their prompts."""
    from prefixgym.envs.registration import make_agent_env
    from prefixgym.prompting.lint.env import lint_conversations
    from prefixgym.prompting.tokenizer import load_tokenizer
    from prefixgym.rollouts.expert import play_expert

    if episodes < 1:
        raise LintInputError(f"--episodes must be at least 1, got {episodes}")
    try:
        env = make_agent_env(env_id, env_kwargs)
    except ValueError as exc:
        raise LintInputError(str(exc)) from None
    tok = tokenizer if tokenizer is not None else load_tokenizer()
    try:
        conversations = [(f"seed {seed}", play_expert(env, tok, seed).conversation)
                         for seed in range(episodes)]
    finally:
        env.close()
    return lint_conversations(env_id, conversations, block_size=block_size)


def price_findings(findings: list[Finding], prices: Prices) -> None:
    """Put in each finding that counted the tokens it makes prefill again what they cost
    beyond a cache hit, at `prices`."""
    rates = f"at {prices.model}'s rates"
    for finding in findings:
        tokens = finding.extra.get("reprefilled_tokens")
        per_turn = finding.extra.get("reprefilled_tokens_per_turn")
        if tokens is not None:
            cost = money(prices.miss_cost(tokens), prices.currency)
            finding.extra["reprefill_money"] = f"{cost} beyond cache hits {rates}"
        elif per_turn is not None:
            cost = money(prices.miss_cost(per_turn) * 1_000_000, prices.currency)
            finding.extra["reprefill_money"] = f"{cost} per million turns beyond cache hits {rates}"


def exit_code(report: Report) -> int:
    """1 when an error is left after --select/--ignore, or when a template's verdict is no
    though no error says why (no probe could be checked); else 0, warnings or not."""
    if any(f.severity == "error" for f in report.findings):
        return 1
    unchecked = getattr(report, "num_checked_by_default", 1) == 0
    return 1 if unchecked and not report.append_only else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:  # argparse: --help exits 0, a usage error 2
        return int(exc.code or 0)
    try:
        config = load_config()
        if args.select is not None:
            config.select = parse_codes(args.select)
        if args.ignore is not None:
            config.ignore = parse_codes(args.ignore)
        if getattr(args, "block_size", None) is not None:
            config.block_size = args.block_size
        if getattr(args, "capacity_tokens", None) is not None:
            config.capacity_tokens = args.capacity_tokens
        config.__post_init__()
        prices = (run_prices("", args.price_model or "", args.prices or "")[0]
                  if args.prices or args.price_model else None)
        report = _run(args, config)
    except (LintInputError, ValueError) as exc:
        print(f"prefixgym lint: error: {error_line(exc)}", file=sys.stderr)
        return 2
    report.findings = filter_findings(report.findings, config.select, config.ignore)
    switches: list[Finding] = getattr(report, "switches", [])
    switches[:] = filter_findings(switches, config.select, config.ignore)
    if prices is not None:
        price_findings(report.findings + switches, prices)
    fixed: TemplateFix | None = getattr(args, "fixed", None)
    try:
        if args.format == "json":
            data = report.to_json()
            if fixed is not None:
                data["fix"] = {"path": args.fix if fixed.variant is not None else None,
                               "refused": fixed.refused or None, "diff": fixed.diff,
                               "report": fixed.report.to_json()
                               if fixed.variant is not None and fixed.report else None}
            print(json.dumps(data, ensure_ascii=False))
        else:
            print(render_text(report, use_colour=sys.stdout.isatty()))
            if fixed is not None:
                print("\n".join(fix_lines(fixed, args.fix)))
        sys.stdout.flush()
    except BrokenPipeError:  # `prefixgym lint ... | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if fixed is not None and not report.append_only:
        return 0 if fixed.variant is not None else 1
    return exit_code(report)


if __name__ == "__main__":
    sys.exit(main())
