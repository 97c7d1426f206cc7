from prefixgym.trainer.report import improvement_lines


def test_report_states_the_gain_over_the_warm_start_with_its_error():
    evals = [
        {"when": "after warm start", "eval/success": 0.5, "eval/success_stderr": 0.03},
        {"when": "GRPO", "eval/success": 0.6, "eval/success_stderr": 0.03},
        {"when": "GRPO", "eval/success": 0.7, "eval/success_stderr": 0.04},
    ]
    [line, _] = improvement_lines(evals)
    assert "+20.0 points of success ± 5.0" in line and "+4.0 SE" in line
    assert improvement_lines(evals[:1]) == []
