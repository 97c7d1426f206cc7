from prefixgym.trainer.report import branch_lines, improvement_lines, phase_table
from prefixgym.types import Usage


def test_report_states_the_gain_over_the_warm_start_with_its_error():
    evals = [
        {"when": "after warm start", "eval/success": 0.5, "eval/success_stderr": 0.03},
        {"when": "GRPO", "eval/success": 0.6, "eval/success_stderr": 0.03},
        {"when": "GRPO", "eval/success": 0.7, "eval/success_stderr": 0.04},
    ]
    [line, _] = improvement_lines(evals)
    assert "+20.0 points of success ± 5.0" in line and "+4.0 SE" in line
    assert improvement_lines(evals[:1]) == []


def test_phase_table_shows_what_training_would_have_computed_without_sharing():
    table = phase_table(Usage(prefill_computed_tokens=100, prefill_cached_tokens=900,
                              sampled_tokens=50, train_computed_tokens=3_000,
                              train_shared_tokens=9_000, train_loss_tokens=400))
    assert "| train, shared prefix (computed once for several datums) | 9,000 |" in table
    assert "training would have computed 12,000 tokens instead of 3,000" in table
    assert "**3,150**" in table  # computed in all: prefill + sample + train, as computed


def test_an_agent_programs_branches_are_named_with_their_cost():
    records = [
        {"step": 0, "phase": "grpo", "agent/branches": 2.0, "tokens/branch_reprefilled": 130.0,
         "agent/first_branch": "step0.g1/3: call 1: PG204 message 1 (user) was edited; 65 of "
                               "its 80 prompt tokens prefilled again"},
        {"step": 1, "phase": "grpo"},
        {"step": 2, "phase": "grpo", "agent/branches": 1.0, "tokens/branch_reprefilled": 40.0},
        {"step": 2, "phase": "eval", "agent/branches": 9.0},
    ]
    lines = branch_lines(records)
    assert lines[0] == "## Branches of the agent program"
    assert "3 branches in 2 GRPO steps" in lines[2] and "170 prompt tokens prefilled again" in lines[2]
    assert lines[4] == ("- step 0: step0.g1/3: call 1: PG204 message 1 (user) was edited; 65 of "
                        "its 80 prompt tokens prefilled again")
    assert branch_lines([{"step": 0, "phase": "grpo"}]) == []
