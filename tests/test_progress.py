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
