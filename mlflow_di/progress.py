"""Progress for long loops: a live bar on a terminal, plain periodic lines in logs and CI.

A tqdm bar redraws with carriage returns, which a log file or CI console shows as one endless
line (or thousands of lines). Off a terminal, :func:`progress_bar` keeps tqdm's counting and
rate but writes one ordinary line at most every :data:`PLAIN_INTERVAL_S` seconds (nothing for a
loop that ends sooner). :class:`BudgetProgress` counts a fuzz campaign's progress in budget spent.
"""
from __future__ import annotations

import sys

from tqdm.auto import tqdm

#: Seconds between two progress lines when stderr is not a terminal.
PLAIN_INTERVAL_S = 10.0


class _Lines:
    """A file-like target that turns tqdm's carriage-return redraws into whole lines."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> None:
        text = text.replace("\r", "").strip()
        if text:
            self.stream.write(text + "\n")

    def flush(self) -> None:
        self.stream.flush()


class _PlainBar(tqdm):
    """tqdm off a terminal: postfix changes wait for the next periodic line."""

    def set_postfix(self, ordered_dict=None, refresh=True, **kwargs):
        super().set_postfix(ordered_dict, refresh=False, **kwargs)


def progress_bar(*args, **kwargs) -> tqdm:
    """``tqdm(*args, **kwargs)`` on a terminal; periodic plain lines elsewhere."""
    stream = kwargs.get("file") or sys.stderr
    if kwargs.get("disable") or getattr(stream, "isatty", lambda: False)():
        return tqdm(*args, **kwargs)
    # delay: loops shorter than one interval print nothing at all off a terminal
    kwargs.update(file=_Lines(stream), mininterval=PLAIN_INTERVAL_S, maxinterval=PLAIN_INTERVAL_S, ascii=True,
                  delay=PLAIN_INTERVAL_S)
    return _PlainBar(*args, **kwargs)


#: A sequential campaign shows an estimate once the standard error of its mean seconds per seed is
#: at most this share of the mean (about 2x at worst at two standard errors).
SEQUENTIAL_RELATIVE_ERROR = 0.25


class BudgetProgress:
    """A fuzz campaign's progress bar whose estimate of the time left means something from the
    first line.

    Seeds finish in bursts: the easy ones within a few queries, the fruitless ones all at the query
    cap together, at the end. Extrapolated from finished seeds alone, the first line of a LeNet-5
    campaign (L-inf <= 32, 2,000 queries, 100 seeds) estimated 358 s for a campaign that took 47 s.
    Each seed's budget (its query cap, or its timeout, whichever it nears first) bounds the work
    left: the budget the unfinished seeds have not spent, at the rate the campaign has spent budget
    so far. The bar shows the smaller of that bound and the extrapolation from finished seeds (which
    is right when every seed finishes early, as unconstrained DFlare's do).

    A ``sequential`` campaign (one seed after another: the boundary walk) spends its time in
    gradient passes that no query budget counts, so it extrapolates from finished seeds alone, and
    shows no estimate until the standard error of the mean seconds per seed is at most
    :data:`SEQUENTIAL_RELATIVE_ERROR` of it: a few fruitless seeds cost as much as dozens of easy
    ones. Measured in benchmarks/RESULTS.md (bench_progress). After the times the bar shows finished
    seeds, triggers and queries per second.
    """

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}"
    #: a sequential campaign before its estimate: the share of seeds finished, no time left
    FORMAT_NO_ESTIMATE = "{desc}: {percentage:3.0f}%|{bar}| {elapsed}<?{postfix}"

    def __init__(self, seeds: int, finished: int, desc: str, disable: bool = False, sequential: bool = False):
        self.seeds, self.finished, self._finished_before = seeds, finished, finished
        self.sequential = sequential
        self.triggers = 0
        self._spent_finished = 0.0  # budget shares spent by the seeds finished in this run
        # count, sum and sum of squares of the charged seconds of the seeds finished in this run
        self._seconds = [0, 0.0, 0.0]
        self._estimating = False
        # smoothing=0: tqdm's estimate is then (total - n) * elapsed / (n - initial), which show() sets
        self.bar = progress_bar(total=seeds, initial=finished, desc=desc, disable=disable, dynamic_ncols=True,
                                bar_format=self.FORMAT, smoothing=0)

    def finish(self, share: float, trigger: bool, seconds: float = 0.0) -> None:
        """Count one finished seed that spent ``share`` of its budget (see :func:`budget_share`) and
        ``seconds`` of compute."""
        self.finished += 1
        self.triggers += bool(trigger)
        self._spent_finished += share
        self._seconds = [self._seconds[0] + 1, self._seconds[1] + seconds, self._seconds[2] + seconds * seconds]

    def _settled(self) -> bool:
        """Whether the mean seconds per seed is known well enough to extrapolate from (sequential)."""
        if self._estimating:
            return True  # once shown, the estimate stays
        n, total, squares = self._seconds
        if n < 5:
            return False
        mean = total / n
        variance = max(0.0, squares - n * mean * mean) / (n - 1)  # from running sums: no pass per redraw
        self._estimating = mean > 0 and (variance / n) ** 0.5 <= SEQUENTIAL_RELATIVE_ERROR * mean
        return self._estimating

    def show(self, running: float = 0.0, queries_per_s: float | None = None) -> None:
        """Redraw; ``running`` is the summed budget shares spent by the seeds being searched."""
        todo = self.seeds - self._finished_before
        if todo <= 0:
            return
        spent = self._spent_finished + running
        left = max(0.0, (self.seeds - self.finished) - running)  # budget the unfinished seeds may still spend
        by_budget = spent / (spent + left) if spent + left > 0 else 1.0
        by_seeds = (self.finished - self._finished_before) / todo
        if self.finished >= self.seeds:
            fraction = 1.0
        elif self.sequential:
            fraction = by_seeds
            self.bar.bar_format = self.FORMAT if self._settled() else self.FORMAT_NO_ESTIMATE
        else:
            fraction = min(max(by_budget, by_seeds), 1.0)
        postfix = {"seeds": f"{self.finished}/{self.seeds}", "triggers": self.triggers}
        if queries_per_s is not None:
            postfix["queries_per_s"] = f"{queries_per_s:.0f}"
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(self._finished_before + fraction * todo - self.bar.n)

    def write(self, text: str) -> None:
        self.bar.write(text)

    def close(self) -> None:
        self.bar.close()


def budget_share(queries: int, seconds: float, max_queries: int | None, timeout: float | None) -> float:
    """The share of one seed's budget spent: the further of its queries over ``max_queries`` and its
    seconds over ``timeout`` (each only when set), at most 1."""
    shares = [0.0]
    if max_queries:
        shares.append(queries / max_queries)
    if timeout:
        shares.append(seconds / timeout)
    return min(1.0, max(shares))
