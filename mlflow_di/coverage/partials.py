"""Coverage passes as per-batch jobs whose partial results merge into exactly the one-process result.

The expensive part of fitting and scoring coverage is the passes over the images: a forward pass
recording some layers' neuron values, and for IDC a forward+LRP pass. :class:`FitJob` and
:class:`ScoreJob` compute what one batch of those passes contributes; a *passes executor* runs a
job over every batch and hands the partial results back in batch order: :class:`LocalPasses` in
this process, :class:`~mlflow_di.coverage.distributed.RayPasses` on a pool of Ray actors.
``CoverageSuite.fit``/``score`` with ``passes=`` then merge the partials on the driver.

Same numbers as the local path (``passes=None``):

- The batches are those of the local path, ``[a, a + batch_size)``, each computed as one batch:
  a convolution's float result for an input can depend on the other inputs of its batch.
- What merges by a union or an extremum is exact in any order: per-neuron min/max (KMNC/NBC/SNAC
  bounds), the covered cells of NC, KMNC, NBC, SNAC and TKNC (boolean arrays OR-ed).
- IDC's importance (summed relevance per neuron) is a sum of floats, whose value depends on the
  order of the additions. :class:`ExactSum` adds them without rounding (integers, see there) and
  rounds once at the end, so any split into batches gives the same bits; the local path uses the
  same sum.

What stays per input (documented where it is produced): in a batch's result, only IDC's
combination id of each test input (8 bytes per input, for the report's growth curve); in *trace
files*, the rows the driver's math needs in full: the analysis inputs' activations of the IDC
layers (the driver reads back only the columns of the ``top_m`` important neurons to cluster
them) and the surprise-adequacy traces of LSC/DSC with each input's predicted class (their KDE
and nearest-neighbour search need every training trace, and LSA/DSA are per input). Trace files are Parquet, one per
batch, written by whoever computes the
batch and read back by the driver batch by batch into arrays allocated once
(:class:`~mlflow_di.coverage.activations.RowBuffer`), so no pass result travels through the
driver's memory or Ray's object store as one piece.
"""
from __future__ import annotations

import contextlib
import dataclasses
import pathlib
import shutil
import tempfile
from typing import Mapping, Sequence

import numpy as np

from mlflow_di.errors import UserError

#: Bits per integer limb of :class:`ExactSum`; a limb holds values below 2^42 (a 27-bit half of a
#: mantissa shifted by at most 15), so 2^20 rows can be added before the limbs are folded.
_LIMB_BITS = 16
_ROWS_PER_FOLD = 1 << 18
#: 2^-1126 is below every float64's last bit (smallest subnormal 2^-1074, 53-bit mantissas):
#: every finite float64 is an integer multiple of it.
_OFFSET = 1126
_LIMBS = (2097 + 26) // _LIMB_BITS + 2


class ExactSum:
    """Column sums of float arrays without rounding: add in any order or split, merge, then :meth:`value`.

    Every finite float64 is an integer times 2^-1126, so the sum of any number of them is an
    integer times 2^-1126 too: each value's mantissa is split in two 27-bit halves, added into
    16-bit-aligned int64 limbs per column (vectorised), and the limbs are folded into Python
    integers now and then. :meth:`value` divides by 2^1126 once, correctly rounded (Python's int
    division), so the result is the exactly rounded float64 sum whatever the order or the
    batches. NaN, or +inf with -inf, gives NaN; +inf or -inf alone gives that infinity.
    """

    def __init__(self, columns: int):
        self.columns = int(columns)
        self.totals = [0] * self.columns
        self.nan = np.zeros(self.columns, dtype=bool)
        self.pos_inf = np.zeros(self.columns, dtype=bool)
        self.neg_inf = np.zeros(self.columns, dtype=bool)

    def add(self, values: np.ndarray) -> "ExactSum":
        """Add the rows of ``values`` (rows, columns) column by column."""
        values = np.asarray(values, dtype=np.float64).reshape(-1, self.columns)
        for start in range(0, len(values), _ROWS_PER_FOLD):
            self._add_block(values[start:start + _ROWS_PER_FOLD])
        return self

    def _add_block(self, block: np.ndarray) -> None:
        finite = np.isfinite(block)
        self.nan |= np.isnan(block).any(axis=0)
        self.pos_inf |= (block == np.inf).any(axis=0)
        self.neg_inf |= (block == -np.inf).any(axis=0)
        fraction, exponent = np.frexp(np.where(finite, block, 0.0))
        mantissa = (fraction * 2.0**53).astype(np.int64)  # exact: |mantissa| < 2^53
        shift = exponent.astype(np.int64) - 53 + _OFFSET  # value = mantissa * 2^(shift - OFFSET), shift >= 0
        high = mantissa >> 26
        low = mantissa - (high << 26)  # 0 <= low < 2^26
        limbs = np.zeros((self.columns, _LIMBS), dtype=np.int64)
        column = np.broadcast_to(np.arange(self.columns), block.shape)
        for part, at in ((high, shift + 26), (low, shift)):
            np.add.at(limbs, (column, at // _LIMB_BITS), part << (at % _LIMB_BITS))
        weights = [1 << (_LIMB_BITS * i) for i in range(_LIMBS)]
        for index, row in enumerate(limbs.tolist()):
            self.totals[index] += sum(limb * weight for limb, weight in zip(row, weights) if limb)

    def merge(self, other: "ExactSum") -> "ExactSum":
        """This sum plus ``other``'s (same columns); exact, so the order of merging does not matter."""
        if other.columns != self.columns:
            raise ValueError(f"cannot merge sums of {other.columns} and {self.columns} columns")
        self.totals = [a + b for a, b in zip(self.totals, other.totals)]
        self.nan |= other.nan
        self.pos_inf |= other.pos_inf
        self.neg_inf |= other.neg_inf
        return self

    def value(self) -> np.ndarray:
        """The sums as float64, each the exactly rounded value of the true sum."""
        scale = 1 << _OFFSET
        out = np.empty(self.columns, dtype=np.float64)
        for index, total in enumerate(self.totals):
            try:
                out[index] = total / scale
            except OverflowError:
                out[index] = np.inf if total > 0 else -np.inf
        out[self.pos_inf] = np.inf
        out[self.neg_inf] = -np.inf
        out[self.nan | (self.pos_inf & self.neg_inf)] = np.nan
        return out


def exact_column_sums(values: np.ndarray) -> np.ndarray:
    """The exactly rounded float64 sum of each column of ``values`` (see :class:`ExactSum`)."""
    values = np.asarray(values)
    return ExactSum(values.shape[1] if values.ndim == 2 else 1).add(values).value()


# ------------------------------------------------------------------------------------ trace files
def write_trace(folder: str | pathlib.Path, start: int, columns: Mapping[str, np.ndarray]) -> None:
    """One batch's per-input rows (arrays of equal length, named) as ``folder/START.parquet``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    table = pa.table({name: pa.array(np.ascontiguousarray(values)) for name, values in columns.items()})
    partial = folder / f".{start:012d}.parquet.tmp"
    pq.write_table(table, partial)
    partial.replace(folder / f"{start:012d}.parquet")  # a reader never sees half a file


def read_trace(folder: str | pathlib.Path, starts: Sequence[int], rows: int, columns: Sequence[str]
               ) -> dict[str, np.ndarray]:
    """``columns`` of the batches written at ``starts`` (in that order), ``rows`` rows in all, read one
    file at a time into arrays allocated once."""
    from mlflow_di.coverage.activations import RowBuffer

    buffer = RowBuffer(rows)
    for at, table in _trace_tables(folder, starts, rows, columns):
        buffer.write(at, {name: table.column(name).to_numpy() for name in columns})
    return {name: buffer.arrays.get(name, np.empty(0)) for name in columns}


def read_matrix(folder: str | pathlib.Path, starts: Sequence[int], rows: int, columns: Sequence[str],
                dtype=np.float32) -> np.ndarray:
    """``columns`` side by side as one (rows, len(columns)) array, allocated once and filled file by file."""
    out = np.empty((rows, len(columns)), dtype=dtype)
    for at, table in _trace_tables(folder, starts, rows, columns):
        for index, name in enumerate(columns):
            out[at:at + table.num_rows, index] = table.column(name).to_numpy()
    return out


def _trace_tables(folder, starts, rows, columns):
    """(first row, table of ``columns``) of each batch's trace file, in ``starts`` order; checks files and rows."""
    import pyarrow.parquet as pq

    folder, at = pathlib.Path(folder), 0
    for start in starts:
        path = folder / f"{start:012d}.parquet"
        if not path.is_file():
            raise UserError(f"the trace file of the batch at input {start} is not in '{folder}': the workers "
                            "write where the driver cannot read; give a trace folder every node shares")
        table = pq.read_table(path, columns=list(columns))
        yield at, table
        at += table.num_rows
    if at != rows:
        raise UserError(f"the trace files in '{folder}' hold {at} rows, not {rows}")


def relevance_prefix(layer: str) -> str:
    """The trace columns' prefix of a layer's per-input relevance."""
    return f"relevance:{layer}"


def neuron_columns(prefix: str, neurons: Sequence[int]) -> list[str]:
    """Trace column names of some neurons of a layer (or of the SA trace, ``prefix`` ``"sa"``)."""
    return [f"{prefix}#{int(j)}" for j in neurons]


# ------------------------------------------------------------------------------------------- jobs
@dataclasses.dataclass
class FitJob:
    """One batch of the fitting passes: IDC's forward+LRP pass and the classic criteria's forward pass.

    Per batch it returns (see :func:`merge_fit`) the number of inputs, per IDC layer the exact
    relevance sums over the batch's analysis inputs and their count, and the per-neuron min/max of
    the criteria's layers; it writes to the trace file the analysis inputs' activations of the IDC
    layers (``LAYER#j``), with ``relevance_traces`` their relevance too (``relevance:LAYER#j``: what
    IDC's analysis-data resamples refit importance from), and every input's SA trace (``sa#j``) and
    predicted class (``prediction``).
    """

    idc_layers: list[str]
    rule: str = "epsilon"
    epsilon: float | None = None
    only_correct: bool = True
    classic: dict | None = None  # ClassicCoverage settings with layers_/sa_layers_ (see _classic_from)
    relevance_traces: bool = False
    #: what fx traces told about the model's structure, found on this job's (this worker's copy's) first batch
    #: and kept for the others (:func:`~mlflow_di.coverage.canonizers.traced_once`)
    _traced: dict = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """A copy sent to a worker starts without this process's trace facts: they name this process's modules."""
        return {**self.__dict__, "_traced": {}}

    def __call__(self, model, images: np.ndarray, labels: np.ndarray, start: int, traces) -> dict:
        from mlflow_di.coverage.activations import PreprocessedImages
        from mlflow_di.coverage.canonizers import traced_once
        from mlflow_di.coverage.relevance import layer_relevance

        partial: dict = {"start": start, "rows": len(images)}
        columns: dict[str, np.ndarray] = {}
        if self.idc_layers:
            with traced_once(self._traced):
                attribution = layer_relevance(model.module, PreprocessedImages(images, model.preprocessing),
                                              self.idc_layers, rule=self.rule, epsilon=self.epsilon,
                                              batch_size=len(images), progress=False)
            analysed = attribution.predictions == labels if self.only_correct else np.ones(len(labels), bool)
            partial["n_analysis"] = int(analysed.sum())
            partial["importance"] = {}
            for layer in self.idc_layers:
                relevance = attribution.relevance[layer][analysed]
                partial["importance"][layer] = ExactSum(attribution.relevance[layer].shape[1]).add(relevance)
                values = attribution.activations[layer][analysed]
                columns.update(zip(neuron_columns(layer, range(values.shape[1])), values.T))
                if self.relevance_traces:
                    columns.update(zip(neuron_columns(relevance_prefix(layer), range(relevance.shape[1])), relevance.T))
            write_trace(pathlib.Path(traces) / "idc", start, columns)  # zero rows when none is analysed
        if self.classic is not None:
            classic = _classic_from(self.classic)
            values, predictions = classic.collect(model, images)
            side = np.concatenate([values[layer].reshape(len(images), -1) for layer in classic.layers_], axis=1)
            partial["low"], partial["high"] = side.min(axis=0), side.max(axis=0)
            partial["layer_sizes"] = [int(values[layer].reshape(len(images), -1).shape[1]) for layer in classic.layers_]
            if classic.sa_layers_:
                trace = np.concatenate([values[layer].reshape(len(images), -1) for layer in classic.sa_layers_], axis=1)
                write_trace(pathlib.Path(traces) / "sa", start,
                            {"prediction": predictions.astype(np.int64),
                             **dict(zip(neuron_columns("sa", range(trace.shape[1])), trace.T))})
        return partial


@dataclasses.dataclass
class FitMerged:
    """The fitting passes' partials merged: what :meth:`CoverageSuite.fit` needs besides the trace files."""

    rows: int
    starts: list[int]
    n_analysis_by_batch: list[int]
    importance: dict[str, np.ndarray]
    low: np.ndarray | None
    high: np.ndarray | None
    layer_sizes: list[int] | None


def merge_fit(partials: Sequence[dict]) -> FitMerged:
    """:class:`FitJob` partials (any order) merged; exact whatever the order (see the module docstring)."""
    partials = sorted(partials, key=lambda p: p["start"])
    importance: dict[str, ExactSum] = {}
    low = high = sizes = None
    for partial in partials:
        for layer, sums in partial.get("importance", {}).items():
            importance[layer] = importance[layer].merge(sums) if layer in importance else sums
        if "low" in partial:
            low = partial["low"] if low is None else np.minimum(low, partial["low"])
            high = partial["high"] if high is None else np.maximum(high, partial["high"])
            sizes = partial["layer_sizes"]
    return FitMerged(
        rows=sum(p["rows"] for p in partials), starts=[p["start"] for p in partials],
        n_analysis_by_batch=[p.get("n_analysis", 0) for p in partials],
        importance={layer: sums.value() for layer, sums in importance.items()},
        low=None if low is None else low.astype(np.float64), high=None if high is None else high.astype(np.float64),
        layer_sizes=sizes)


@dataclasses.dataclass
class ScoreJob:
    """One batch of a scoring pass: the classic criteria's covered cells and IDC's combination ids.

    Returns the batch's cells of NC, KMNC, NBC/SNAC and TKNC (boolean arrays, united by
    :func:`merge_score`) and per IDC layer the combination id of each input (kept per input for
    the growth curve); writes every input's SA trace and predicted class to the trace file.
    ``classic``: the fitted criteria's settings and bounds (no training traces); ``idc``: the
    fitted layers (:class:`~mlflow_di.coverage.idc.LayerCoverage`), their preprocessing and
    batch size.
    """

    classic: dict | None
    idc: dict | None

    def __call__(self, model, images: np.ndarray, labels: np.ndarray, start: int, traces) -> dict:
        from mlflow_di.coverage.criteria import Batch, batch_cells

        partial: dict = {"start": start, "rows": len(images), "cells": {}, "combinations": {}}
        activations: dict = {}
        if self.classic is not None:
            classic = _classic_from(self.classic)
            criteria = classic._criteria()
            activations, predictions = classic.collect(model, images)
            values = np.concatenate([activations[layer].reshape(len(images), -1) for layer in classic.layers_], axis=1)
            scaled = np.concatenate([activations[f"{layer}:nc"].reshape(len(images), -1) for layer in classic.layers_],
                                    axis=1) if "nc" in criteria else None
            partial["cells"] = batch_cells(criteria, Batch(values, scaled, self.classic["low"], self.classic["high"],
                                                           self.classic["layer_sizes"]), classic)
            if classic.sa_layers_:
                trace = np.concatenate([activations[layer].reshape(len(images), -1) for layer in classic.sa_layers_],
                                       axis=1)
                write_trace(pathlib.Path(traces) / "sa", start,
                            {"prediction": predictions.astype(np.int64),
                             **dict(zip(neuron_columns("sa", range(trace.shape[1])), trace.T))})
        if self.idc is not None:
            fitted = self.idc["layers"]
            if not all(layer in activations for layer in fitted):  # as the local path: a pass of IDC's own
                from mlflow_di.coverage.activations import PreprocessedImages, collect_activations
                from mlflow_di.models.preprocessing import Preprocessing

                inputs = PreprocessedImages(images, Preprocessing.from_dict(self.idc["preprocessing"]))
                activations = collect_activations(model.module, inputs, list(fitted), batch_size=len(images))
            partial["combinations"] = {layer: layer_fit.combinations(np.asarray(activations[layer]))
                                       for layer, layer_fit in fitted.items()}
            partial["resampled"] = {layer: layer_fit.resampled_combinations(np.asarray(activations[layer]))
                                    for layer, layer_fit in fitted.items()}
        return partial


@dataclasses.dataclass
class ScoreMerged:
    """A scoring pass's partials merged: united cells, combination ids in input order (``resampled``: under each
    analysis-data resample's clusters, (resamples, rows) per layer)."""

    rows: int
    starts: list[int]
    cells: dict[str, np.ndarray]
    combinations: dict[str, np.ndarray]
    resampled: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)


def merge_score(partials: Sequence[dict]) -> ScoreMerged:
    """:class:`ScoreJob` partials (any order) merged: cells OR-ed (how every cell criterion merges: its
    record's ``merge`` is ``or``, see :data:`~mlflow_di.coverage.criteria.CRITERION`), per-input ids
    concatenated in input order."""
    partials = sorted(partials, key=lambda p: p["start"])
    cells: dict[str, np.ndarray] = {}
    for partial in partials:
        for name, covered in partial["cells"].items():
            cells[name] = covered if name not in cells else cells[name] | covered
    layers = partials[0]["combinations"].keys() if partials else ()
    combinations = {layer: np.concatenate([p["combinations"][layer] for p in partials]).astype(np.int64)
                    for layer in layers}
    resampled = {layer: np.concatenate([p["resampled"][layer] for p in partials], axis=1).astype(np.int64)
                 for layer in layers if all(layer in p.get("resampled", {}) for p in partials)}
    return ScoreMerged(sum(p["rows"] for p in partials), [p["start"] for p in partials], cells, combinations, resampled)


def classic_settings(classic) -> dict:
    """What a job needs of a :class:`~mlflow_di.coverage.criteria.ClassicCoverage` to collect its
    activations: its parameters and resolved layers (never its fitted traces)."""
    params = classic.get_params()
    params.update(progress=False, batch_size=max(int(classic.batch_size), 1))
    return {"params": params, "layers_": list(classic.layers_), "sa_layers_": list(classic.sa_layers_)}


def _classic_from(settings: dict):
    from mlflow_di.coverage.criteria import ClassicCoverage

    classic = ClassicCoverage(**settings["params"])
    classic.layers_, classic.sa_layers_ = list(settings["layers_"]), list(settings["sa_layers_"])
    return classic


# -------------------------------------------------------------------------------------- executors
def batch_ranges(total: int, batch_size: int) -> list[tuple[int, int]]:
    """The local path's batches: ``[a, a + batch_size)`` up to ``total``."""
    if batch_size < 1:
        raise UserError(f"batch_size must be at least 1, got {batch_size}")
    return [(start, min(start + batch_size, total)) for start in range(0, total, batch_size)]


@dataclasses.dataclass
class PassOutput:
    """A pass's partials (in batch order) and the folder of its trace files (removed by :meth:`close`)."""

    partials: list[dict]
    traces: pathlib.Path
    owned: bool = True

    def close(self) -> None:
        if self.owned:
            shutil.rmtree(self.traces, ignore_errors=True)


class LocalPasses:
    """Runs a job over every batch in this process: the reference for :class:`RayPasses`, and for tests.

    ``trace_dir``: where trace files go (default: a new temporary folder per pass, removed after).
    """

    def __init__(self, trace_dir: str | None = None):
        self.trace_dir = trace_dir

    @contextlib.contextmanager
    def run(self, job, model, images, batch_size: int):
        """Yield a :class:`PassOutput` of ``job`` over ``images`` (an ImageSet) in the local path's batches."""
        output = PassOutput([], new_trace_folder(self.trace_dir))
        try:
            for start, stop in batch_ranges(len(images), batch_size):
                output.partials.append(job(model, images.images[start:stop], images.labels[start:stop], start,
                                           output.traces))
            yield output
        finally:
            output.close()

    @contextlib.contextmanager
    def run_many(self, job, model, sets, batch_size: int):
        """Yield a :class:`PassOutput` per ImageSet of ``sets`` (one after another here)."""
        with contextlib.ExitStack() as stack:
            yield [stack.enter_context(self.run(job, model, images, batch_size)) for images in sets]


def new_trace_folder(parent: str | None) -> pathlib.Path:
    """A new empty folder for one pass's trace files (inside ``parent`` when given)."""
    if parent is not None:
        pathlib.Path(parent).mkdir(parents=True, exist_ok=True)
    return pathlib.Path(tempfile.mkdtemp(prefix="mlflow-di-traces-", dir=parent))
