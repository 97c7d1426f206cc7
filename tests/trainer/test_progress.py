"""Progress in a log: plain lines at the start, about every tenth, and at the end."""

import io

from prefixgym.trainer.progress import Progress


def test_a_log_gets_a_line_per_tenth_with_the_latest_figures():
    log = io.StringIO()  # not a terminal
    with Progress("warm start", 20, "step", stream=log) as progress:
        for i in range(20):
            progress.update(1, loss=f"{1 / (i + 1):.2f}")
    lines = log.getvalue().splitlines()
    assert lines[0] == "warm start: 20 steps"
    assert [line.split(" ")[2] for line in lines[1:-1]] == [f"{k}/20" for k in range(2, 20, 2)]
    assert lines[-1].startswith("warm start: 20/20 steps") and lines[-1].endswith(
        "; loss 0.05 done")
    assert "\r" not in log.getvalue()


def test_disabled_or_empty_progress_prints_nothing():
    log = io.StringIO()
    for progress in (Progress("eval", 10, "episode", enabled=False, stream=log),
                     Progress("GRPO", 0, "step", stream=log)):
        progress.update(3)
        progress.close()
    assert log.getvalue() == ""


def test_a_resumed_phase_counts_from_where_it_was():
    log = io.StringIO()
    progress = Progress("GRPO", 10, "step", initial=7, stream=log)
    progress.update(3, reward="0.50")
    progress.close()
    assert log.getvalue().splitlines()[0] == "GRPO: 3 steps"
    assert "10/10 steps" in log.getvalue()
