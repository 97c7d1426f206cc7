"""Trace replay: predicted hit rates and one test per PG2xx rule that fires and one that does not."""

from __future__ import annotations

import lint_traces as L

from prefixgym.prompting.lint.cache_sim import SimulatedPrefixCache
from prefixgym.prompting.lint.trace import analyze_trace

REPLY = "I will look up the answer about abba and the abacus."


def rules(lines: list[dict], decode=L.decode, block_size: int = 4) -> list[str]:
    return [f.rule for f in analyze_trace(L.requests(lines), block_size, 1 << 16, decode).findings]


def clean_trace() -> list[dict]:
    return (L.two_turn_episode("e0", "Find the capital of France.", REPLY, "Paris. Go on.")
            + L.two_turn_episode("e1", "Find the capital of Peru.", REPLY, "Lima. Go on."))


def test_cache_sim_matches_full_blocks_and_evicts_lru() -> None:
    cache = SimulatedPrefixCache(block_size=4, capacity_tokens=8)
    assert cache.match(list(range(10))) == 0
    cache.insert(list(range(10)))  # two full blocks
    assert cache.match(list(range(10))) == 8
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9]) == 4
    cache.insert([50, 51, 52, 53])  # evicts the least recently used block: [4..7]
    assert cache.num_blocks == 2
    assert cache.match(list(range(10))) == 4
    assert cache.match([0, 1, 2, 3]) == 3  # the last prompt token is always computed


def test_append_only_trace_is_clean_and_hits_predicted() -> None:
    lines = clean_trace()
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    assert report.findings == []
    assert report.append_only
    # turn 1 of each episode reuses its turn-0 prompt + reply, in whole blocks
    first = lines[0]
    reused = len(first["prompt_tokens"]) + len(first["completion_tokens"][0])
    assert report.predicted_cached_tokens >= (reused // 4) * 4
    assert 0 < report.predicted_hit_rate < 1
    assert report.observed_hit_rate is None


def test_observed_hit_rate_read_from_usage() -> None:
    lines = clean_trace()
    for obj in lines:
        n = len(obj["prompt_tokens"])
        obj["usage"] = {"prefill_cached_tokens": n // 2, "prefill_computed_tokens": n - n // 2}
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    total = sum(len(o["prompt_tokens"]) for o in lines)
    assert report.observed_hit_rate == sum(len(o["prompt_tokens"]) // 2 for o in lines) / total


def test_retokenized_history_fires_pg201() -> None:
    lines = L.two_turn_episode("e0", "Find the capital.", REPLY, "Go on.", retokenize=True)
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    assert [f.rule for f in report.findings] == ["PG201"]
    finding = report.findings[0]
    assert finding.first_divergence == len(lines[0]["prompt_tokens"]) + REPLY.index("ab")
    assert finding.extra["expected_tokens"][:2] == [ord("a"), ord("b")]
    assert finding.extra["actual_tokens"][0] == 302
    assert not report.append_only
    assert "PG201" not in rules(clean_trace())


def test_changed_system_prompt_fires_pg202_with_and_without_decoding() -> None:
    changed = L.msg("system", "You are a careful agent. Tools: lookup(query), search(q).")
    lines = (L.two_turn_episode("e0", "Capital of France?", REPLY, "Go on.", next_system=changed)
             + L.two_turn_episode("e1", "Capital of Peru?", REPLY, "Go on."))
    assert rules(lines) == ["PG202"]
    assert rules(lines, decode=None) == ["PG202"]
    assert "PG202" not in rules(clean_trace())


def test_system_prompts_differing_across_episodes_fire_pg202() -> None:
    other = L.msg("system", "You are a careless agent. Tools: lookup(query).")
    lines = (L.two_turn_episode("e0", "Capital of France?", REPLY, "Go on.")
             + L.two_turn_episode("e1", "Capital of Peru?", REPLY, "Go on.", system=other))
    [finding] = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode).findings
    assert finding.rule == "PG202"
    # e1 could have shared e0's system prompt up to its first user turn
    assert finding.extra["reprefilled_tokens"] == (len(L.encode(L.SYSTEM))
                                                   - finding.first_divergence)


def test_timestamp_in_the_prefix_fires_pg203() -> None:
    def system(clock: str) -> str:
        return L.msg("system", f"You are a careful agent. Current time: {clock}.")

    lines = (L.two_turn_episode("e0", "Capital of France?", REPLY, "Go on.",
                                system=system("2025-01-01 10:00:00"),
                                next_system=system("2025-01-01 10:00:07"))
             + L.two_turn_episode("e1", "Capital of Peru?", REPLY, "Go on.",
                                  system=system("2025-01-01 10:00:03")))
    found = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode).findings
    assert {f.rule for f in found} == {"PG203"}
    assert all("timestamp" in f.message for f in found)
    assert "PG203" not in rules(clean_trace())


def test_uuid_differing_across_episodes_fires_pg203() -> None:
    def system(uid: str) -> str:
        return L.msg("system", f"Session {uid}. You are a careful agent.")

    lines = (L.two_turn_episode("e0", "Capital of France?", REPLY, "Go on.",
                                system=system("1b4e28ba-2fa1-11d2-883f-0016d3cca427"))
             + L.two_turn_episode("e1", "Capital of Peru?", REPLY, "Go on.",
                                  system=system("6fa459ea-ee8a-3ca4-894e-db77e160355e")))
    found = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode).findings
    assert [f.rule for f in found] == ["PG203"]
    assert "uuid" in found[0].message


def test_truncated_history_fires_pg204() -> None:
    lines = (L.two_turn_episode("e0", "Capital of France?", REPLY, "Go on.", drop_first_user=True)
             + L.two_turn_episode("e1", "Capital of Peru?", REPLY, "Go on."))
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    assert [f.rule for f in report.findings] == ["PG204"]
    assert report.findings[0].extra["episode_id"] == "e0"
    assert report.findings[0].extra["line"] == 2
    # what it costs: the first turn's prompt + reply from the divergence on
    expected = lines[0]["prompt_tokens"] + lines[0]["completion_tokens"][0]
    missed = len(expected) - report.findings[0].first_divergence
    assert report.findings[0].extra["reprefilled_tokens"] == missed
    assert report.to_json()["reprefilled_tokens_by_rule"] == {"PG204": missed}
    assert "PG204" not in rules(clean_trace())


def test_small_miss_within_one_block_is_not_reported_but_breaks_append_only() -> None:
    lines = clean_trace()
    lines[1]["prompt_tokens"] = lines[1]["prompt_tokens"][:]
    reply_end = len(lines[0]["prompt_tokens"]) + len(lines[0]["completion_tokens"][0]) - 1
    lines[1]["prompt_tokens"][reply_end] = ord("!")  # the last sampled token changed: 1 token
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    assert report.findings == []
    assert not report.append_only


def test_prompt_logprobs_fire_pg205_and_bypass_the_simulated_cache() -> None:
    lines = clean_trace()
    plain = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    lines[1]["include_prompt_logprobs"] = True
    report = analyze_trace(L.requests(lines), 4, 1 << 16, L.decode)
    assert [f.rule for f in report.findings] == ["PG205"]
    assert report.findings[0].extra["lines"] == [2]
    assert report.findings[0].extra["reprefilled_tokens"] == len(lines[1]["prompt_tokens"])
    assert report.predicted_cached_tokens < plain.predicted_cached_tokens
    assert "PG205" not in rules(clean_trace())


def test_group_sent_as_separate_requests_fires_pg206() -> None:
    ids = L.encode(L.prompt(L.msg("user", "Guess my number.")))
    split = [L.line(f"e{i}", 0, ids, L.encode("50<|im_end|>"), group="g0") for i in range(3)]
    found = analyze_trace(L.requests(split), 4, 1 << 16, L.decode).findings
    assert [f.rule for f in found] == ["PG206"]
    assert found[0].extra["lines"] == [1, 2, 3]
    assert found[0].extra["reprefilled_tokens"] == 2 * len(ids)  # the two extra requests
    together = [L.line("e0", 0, ids, None, group="g0", num_samples=3,
                       completion_tokens=[L.encode("50"), L.encode("25"), L.encode("75")])]
    assert rules(together) == []


def test_tasks_with_different_numbers_across_episodes_are_not_volatile_prefixes() -> None:
    # the first user message is the episode's task: numbers differing there are expected
    lines = (L.two_turn_episode("e0", "Say 85.", REPLY, "Go on.")
             + L.two_turn_episode("e1", "Say 47.", REPLY, "Go on."))
    assert rules(lines) == []
    # the same counter inside the system prompt is a volatile prefix
    lines = (L.two_turn_episode("e0", "Say it.", REPLY, "Go on.",
                                system=L.msg("system", "You are agent 85. Reply."))
             + L.two_turn_episode("e1", "Say it.", REPLY, "Go on.",
                                  system=L.msg("system", "You are agent 47. Reply.")))
    assert "PG203" in rules(lines)
