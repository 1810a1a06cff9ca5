"""Progress output: a live bar on a terminal, whole lines (no carriage returns) elsewhere."""
import io

from mlflow_di import progress


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_a_short_loop_prints_nothing_off_a_terminal():
    log = io.StringIO()
    for _ in progress.progress_bar(range(5), desc="seeds", file=log):
        pass
    assert log.getvalue() == ""


def test_off_a_terminal_progress_is_plain_lines(monkeypatch):
    monkeypatch.setattr(progress, "PLAIN_INTERVAL_S", 0.0)
    log = io.StringIO()
    for _ in progress.progress_bar(range(5), desc="seeds", file=log):
        pass
    text = log.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert lines and all(line.startswith("seeds:") for line in lines)
    assert "5/5" in lines[-1]


def test_on_a_terminal_progress_redraws_in_place():
    screen = _Terminal()
    for _ in progress.progress_bar(range(5), desc="seeds", file=screen):
        pass
    assert "\r" in screen.getvalue()


def test_off_a_terminal_postfix_updates_do_not_print_a_line_each():
    log = io.StringIO()
    bar = progress.progress_bar(total=40, desc="training", file=log)
    for epoch in range(40):
        bar.set_postfix(loss=f"{1 / (epoch + 1):.4f}")
        bar.update(1)
    bar.close()
    assert log.getvalue() == ""  # a loop shorter than the interval prints nothing


def test_budget_progress_counts_the_budget_the_unfinished_seeds_may_still_spend():
    bar = progress.BudgetProgress(10, 0, "fuzz", disable=False)
    bar.show(running=5 * 0.5)  # five seeds half way through their budgets, none finished
    assert bar.bar.n == 2.5  # spent 2.5 of the 2.5 + 7.5 budgets left
    bar.finish(0.01, trigger=True)
    bar.finish(0.01, trigger=False)
    bar.show(running=0.0)  # two easy seeds done: extrapolating from seeds (2/10) beats the budget bound
    assert bar.bar.n == 2.0
    assert bar.bar.postfix.startswith("seeds=2/10, triggers=1")
    assert bar.bar.smoothing == 0  # tqdm's estimate is then exactly what n says
    bar.close()


def test_budget_progress_after_a_resume_estimates_only_the_seeds_left():
    bar = progress.BudgetProgress(10, 6, "fuzz")
    bar.show(running=2 * 0.5)  # of the 4 seeds left, two half spent: 1 of 4 budgets
    assert bar.bar.n == 6 + 1
    for _ in range(4):
        bar.finish(1.0, trigger=False)
    bar.show()
    assert bar.bar.n == 10
    bar.close()


def test_budget_share_is_the_further_of_queries_and_seconds():
    assert progress.budget_share(500, 1.0, 2000, 10.0) == 0.25
    assert progress.budget_share(500, 6.0, 2000, 10.0) == 0.6
    assert progress.budget_share(500, 6.0, None, None) == 0.0
    assert progress.budget_share(5000, 0.0, 2000, None) == 1.0


def test_a_sequential_campaign_shows_an_estimate_once_its_mean_seconds_per_seed_is_known():
    bar = progress.BudgetProgress(100, 0, "fuzz", sequential=True)
    for seconds in (0.1, 8.0, 0.1, 0.1, 0.1, 8.0):  # bimodal: standard error 1.6 s of a 2.7 s mean
        bar.finish(0.01, trigger=False, seconds=seconds)
        bar.show()
        assert bar.bar.bar_format == bar.FORMAT_NO_ESTIMATE  # no estimate yet: "?" for the time left
    for number in range(30):  # half fruitless: the mean is then known to within a quarter
        bar.finish(0.01, trigger=True, seconds=0.1 if number % 2 else 8.0)
    bar.show()
    assert bar.bar.n == 36 and bar.bar.bar_format == bar.FORMAT  # extrapolated from the seeds finished
    bar.finish(1.0, trigger=False, seconds=1000.0)
    bar.show()
    assert bar.bar.n == 37 and bar.bar.bar_format == bar.FORMAT  # once shown, the estimate stays
    bar.close()
