"""One JSON round trip for result dataclasses (mlflow_di.results_json), and files written by
earlier code (tests/fixtures/*_v1*, made with the code of commit 050239f) still load and are
written back byte for byte."""
from __future__ import annotations

import dataclasses
import enum
import json
import math
import pathlib

import numpy as np
import pytest

from mlflow_di.compression.methods import CompressionResult
from mlflow_di.fuzz import load_campaign
from mlflow_di.fuzz.results import CampaignConfig, CampaignResult, CampaignSummary, SeedRecord, Stop
from mlflow_di.gate import Verdict
from mlflow_di.results_json import JsonRoundTrip, from_dict, from_json, to_dict, to_json

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


class Colour(str, enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class Inner(JsonRoundTrip):
    name: str
    size: float


@dataclasses.dataclass
class Outer(JsonRoundTrip):
    colour: Colour
    pair: tuple[int, float]
    shape: tuple[int, ...]
    inner: Inner
    inners: list[Inner]
    by_name: dict[str, Inner]
    best: float | None = None
    maybe_pair: tuple[int, int] | None = None
    extra: dict = dataclasses.field(default_factory=dict)

    JSON_DUMPS = {"indent": 1}


def _outer():
    return Outer(Colour.BLUE, (np.int64(3), np.float32(0.5)), (28, 28, 1), Inner("a", math.inf),
                 [Inner("b", -math.inf), Inner("c", np.float64(2.5))], {"d": Inner("d", 1.0)},
                 best=math.inf, maybe_pair=(1, 2), extra={"n": np.int32(4), "t": (1, 2)})


def test_nested_dataclasses_tuples_numpy_enums_and_infinities_round_trip():
    outer = _outer()
    plain = outer.to_dict()
    assert plain["colour"] == "blue" and plain["pair"] == [3, 0.5] and type(plain["pair"][0]) is int
    assert plain["inner"] == {"name": "a", "size": "inf"} and plain["inners"][0]["size"] == "-inf"
    assert plain["best"] == "inf" and plain["extra"] == {"n": 4, "t": [1, 2]}
    text = outer.to_json()
    json.loads(text)  # strict JSON: no Infinity
    assert "Infinity" not in text and text.startswith("{\n \"colour\"")
    again = Outer.from_json(text)
    assert again.colour is Colour.BLUE and again.pair == (3, 0.5) and again.shape == (28, 28, 1)
    assert again.inner == Inner("a", math.inf) and again.inners[0].size == -math.inf
    assert again.by_name == {"d": Inner("d", 1.0)} and again.best == math.inf and again.maybe_pair == (1, 2)
    assert again.to_json() == text


def test_functions_work_on_plain_dataclasses_too():
    @dataclasses.dataclass
    class Plain:
        value: float
        when: tuple[int, int] | None = None

    assert to_dict(Plain(math.nan, (1, 2))) == {"value": "nan", "when": [1, 2]}
    assert math.isnan(from_dict(Plain, {"value": "nan"}).value)
    assert from_json(Plain, to_json(Plain(-math.inf, (3, 4)))) == Plain(-math.inf, (3, 4))
    assert from_json(Plain, '{"value": Infinity}').value == math.inf  # what json.dumps wrote by default


def test_unknown_keys_and_bad_values_are_errors():
    with pytest.raises(TypeError, match="no field"):
        Inner.from_dict({"name": "a", "size": 1.0, "colour": "red"})
    with pytest.raises(ValueError):
        Inner.from_dict({"name": "a", "size": "big"})
    with pytest.raises(ValueError):
        SeedRecord.from_dict({**_record_dict(), "stop": "gave_up"})


def _record_dict():
    return json.loads((FIXTURES / "campaign_v1" / "records.jsonl").read_text().splitlines()[0])


def test_stop_is_an_enum_that_reads_and_writes_the_same_words():
    record = SeedRecord.from_dict(_record_dict())
    assert record.stop is Stop.ALREADY_DEVIATING and record.already_deviating
    assert record.stop == "already_deviating" and f"{record.stop}" == "already_deviating"
    assert str(record.stop) == "already_deviating" and json.dumps(record.stop) == '"already_deviating"'
    assert json.loads(record.to_json())["stop"] == "already_deviating"
    assert SeedRecord(**{**_record_dict(), "stop": "timeout"}).stop is Stop.TIMEOUT


def test_a_campaign_folder_written_by_earlier_code_loads_and_writes_back_the_same_bytes():
    folder = FIXTURES / "campaign_v1"
    result = load_campaign(folder)
    assert result.complete and len(result.records) == 6
    assert [r.stop for r in result.records] == [Stop.MAX_QUERIES] * 2 + [Stop.ALREADY_DEVIATING] + \
        [Stop.MAX_QUERIES] * 2 + [Stop.TRIGGER]
    assert result.config.image_shape == (8, 8, 1) and result.records[5].trigger_labels == (1, 0)
    assert result.trigger_indices.tolist() == [5] and result.triggers.shape == (1, 8, 8, 1)
    config_text = (folder / "campaign.json").read_text()
    assert CampaignConfig.from_json(config_text).to_json() == config_text
    summary_text = (folder / "summary.json").read_text()
    summary = CampaignSummary.from_json(summary_text)
    assert summary.to_json() == summary_text and summary == result.summary
    for line in (folder / "records.jsonl").read_text().splitlines():
        assert SeedRecord.from_json(line).to_json() == line
    assert CampaignResult.from_json(result.to_json()).records == result.records


def test_a_verdict_written_by_earlier_code_loads_and_writes_back_the_same_with_each_checks_outcome():
    """A verdict from before the three outcomes: every check's outcome is derived (PASS when it passed, FAIL when a
    measured value did not, MISSING when nothing was measured); everything else is written back as it was."""
    import json

    text = (FIXTURES / "verdict_v1.json").read_text().rstrip("\n")
    verdict = Verdict.from_json(text)
    assert verdict.passed is False and verdict.measurements[1].value == math.inf
    written = json.loads(verdict.to_json())
    outcomes = [check.pop("outcome") for check in written["checks"]]
    assert outcomes == [("PASS" if c["passed"] else "FAIL" if c["measured"] is not None else "MISSING")
                        for c in json.loads(text)["checks"]]
    assert written == json.loads(text)


def test_a_compression_result_written_by_earlier_code_loads_and_writes_back_the_same_bytes():
    text = (FIXTURES / "compression_result_v1.json").read_text().rstrip("\n")
    result = CompressionResult.from_json(text)
    assert result.quantized_ops == {"QLinearConv": 2} and result.sparsity is None
    assert result.to_json() == text
