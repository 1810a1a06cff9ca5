"""`mlflow-di fuzz` end to end: per-class figures and trigger realism in the run, constraints from the
command line, and several exports against one original in one call (child runs the gate reads)."""
import json

import mlflow
import numpy as np
import pytest

from conftest import active_store, copy_store
from mlflow_di.cli import main
from mlflow_di.fuzz import load_campaign
from mlflow_di.fuzz.results import comparable_records


@pytest.fixture(scope="module")
def exports_store(registered_cnn_store, tmp_path_factory):
    """The store of registered_cnn after `compress --method int8-dynamic,prune-l1` on models:/cnn/1: made once
    for the module, copied by :func:`exports` (each compress took 10-15 s per test)."""
    folder = tmp_path_factory.mktemp("fuzz-command-exports")
    copy_store(registered_cnn_store, folder)
    with active_store(folder):
        code = main(["compress", "--model-uri", "models:/cnn/1", "--method", "int8-dynamic,prune-l1", "--amount",
                     "0.3", "--eval-data", "digits[1300:1400]"])
    assert code == 0
    return folder / "mlflow.db"


@pytest.fixture()
def exports(registered_cnn, exports_store, tmp_path):
    """models:/cnn/1 and its two exports in the test's fresh store (a copy of :func:`exports_store`)."""
    copy_store(exports_store, tmp_path)  # replaces registered_cnn's copy, which nothing has opened yet
    return ["models:/cnn-int8-dynamic/1", "models:/cnn-prune-l1/1"]


def test_one_call_fuzzes_several_exports_with_the_records_of_separate_calls(registered_cnn, exports, tmp_path, capsys):
    common = ["--original", registered_cnn, "--seed-data", "digits[1300:1312]", "--max-queries", "60", "--batch", "4"]
    for number, uri in enumerate(exports):
        assert main(["fuzz", *common, "--compressed", uri, "--out-dir", str(tmp_path / f"alone{number}")]) == 0
    out = tmp_path / "shared.json"
    assert main(["fuzz", *common, "--compressed", exports[0], "--compressed", exports[1],
                 "--out-dir", str(tmp_path / "shared"), "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "saved); " in printed and "fool every compressed model" in printed
    summary = json.loads(out.read_text())
    assert set(summary["campaigns"]) == set(exports)
    assert summary["original_inputs_shared"] <= summary["original_inputs_separate"]
    folders = sorted(p for p in (tmp_path / "shared").iterdir())
    assert [p.name[:3] for p in folders] == ["01-", "02-"]
    for number, folder in enumerate(folders):
        alone, together = load_campaign(tmp_path / f"alone{number}"), load_campaign(folder)
        assert comparable_records(alone) == comparable_records(together)
    client = mlflow.MlflowClient()
    runs = mlflow.search_runs(search_all_experiments=True, output_format="list",
                              filter_string="tags.`mlflow_di.command` = 'fuzz'")
    parent = next(r for r in runs if "original_inputs_shared" in r.data.metrics)
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert parent.info.status == "FINISHED" and "success_rate" not in parent.data.metrics
    assert sorted(c.data.tags["mlflow_di.compressed_uri"] for c in children) == sorted(exports)
    assert all(c.info.status == "FINISHED" and "success_rate" in c.data.metrics for c in children)
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "fuzz")}
    assert {"fuzz/comparison.json", "fuzz/report.html"} <= artifacts
    # overlapping the models with the searches keeps the records (int8-dynamic is left out: its per-call
    # activation scales make its outputs depend on which seeds share a batch, and two shifts batch them differently)
    assert main(["fuzz", *common, "--compressed", exports[1], "--overlap", "--out-dir", str(tmp_path / "overlap")]) == 0
    assert "overlap the searches: two shifts of up to 4 seeds" in capsys.readouterr().out
    assert comparable_records(load_campaign(tmp_path / "overlap")) == comparable_records(load_campaign(tmp_path / "alone1"))
    # the gate reads each export's campaign from its child run
    assert main(["gate", "--model-uri", registered_cnn, "--compressed", exports[1], "--max-success-rate", "1.0"]) == 0


def test_a_campaign_logs_success_by_class_and_how_far_triggers_are_from_their_seeds(registered_cnn, exports, tmp_path):
    folder = tmp_path / "campaign"
    assert main(["fuzz", "--original", registered_cnn, "--compressed", exports[1], "--seed-data", "digits[1300:1330]",
                 "--max-queries", "200", "--max-linf", "48", "--out-dir", str(folder)]) == 0
    result = load_campaign(folder)
    found = [r for r in result.records if r.success]
    assert found, "the pruned export deviates somewhere within 200 queries"
    assert all(r.trigger_distances["linf"] <= 48 for r in found)
    assert all(np.abs(t.astype(int) - s).max() <= 48 for t, s in zip(result.triggers, result.trigger_seeds))
    run = mlflow.search_runs(search_all_experiments=True, output_format="list",
                             filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert json.loads(run.data.tags["mlflow_di.fuzz_constraint"]) == {"max_linf": 48, "min_ssim": None}
    # a constrained campaign answers another question: the gate does not read it, and has nothing to judge (ERROR)
    assert main(["gate", "--model-uri", registered_cnn, "--compressed", exports[1], "--max-success-rate", "1.0"]) == 2
    metrics = run.data.metrics
    assert metrics["trigger_linf_max"] <= 48 and metrics["trigger_l0_median"] >= 1
    labels = {r.label for r in result.records if not r.already_deviating}
    assert {f"class_success_rate.{label}" for label in labels} <= set(metrics)
    assert run.data.params["max_linf"] == "48"
    assert run.data.params["mutations_on"] == "cpu"  # the GPU only for a CUDA original (fuzz/device_mutations.py)
    assert run.data.params["overlap"] == "False"  # on by default only when a model runs on a GPU
    paths = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id, "fuzz")}
    assert {"fuzz/per_class.json", "fuzz/trigger_matrix.json", "fuzz/trigger_distances.json"} <= paths


def test_seeds_stopped_by_the_time_limit_make_the_campaign_incomplete(registered_cnn, exports, tmp_path, capsys):
    """A --timeout far below what a seed needs: the seeds that stop there are counted, logged and named."""
    assert main(["fuzz", "--original", registered_cnn, "--compressed", exports[1], "--seed-data", "digits[1300:1306]",
                 "--strategy", "diffchaser", "--timeout", "0.000001", "--out-dir", str(tmp_path / "c")]) == 0
    out = capsys.readouterr().out
    stopped = sum(str(r.stop) == "timeout" for r in load_campaign(tmp_path / "c").records)
    assert stopped >= 1 and f"INCOMPLETE: {stopped} seed" in out and "is not evidence" in out
    run = mlflow.search_runs(search_all_experiments=True, output_format="list",
                             filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert run.data.metrics["timed_out_seeds"] == stopped


@pytest.mark.parametrize("args, fragment", [
    (["--min-ssim", "0.5"], "--min-ssim needs images of at least 11x11"),
    (["--max-linf", "20", "--strategy", "diffchaser"], "(the dflare strategies, boundary), not diffchaser"),
    (["--max-linf", "0"], "--max-linf"),
    (["--overlap", "--strategy", "deepxplore"], "--overlap applies to the black-box strategies"),
])
def test_bad_constraints_fail_in_one_line(registered_cnn, exports, capsys, args, fragment):
    assert main(["fuzz", "--original", registered_cnn, "--compressed", exports[0], "--seed-data", "digits[0:4]",
                 *args]) == 2
    err = capsys.readouterr().err
    assert fragment in err and "Traceback" not in err


def test_the_same_export_twice_is_refused(registered_cnn, exports, capsys):
    assert main(["fuzz", "--original", registered_cnn, "--compressed", exports[0], "--compressed", exports[0],
                 "--seed-data", "digits[0:4]"]) == 2
    assert "is given twice" in capsys.readouterr().err


def test_resume_finds_each_exports_folder_whatever_the_order(tmp_path):
    from mlflow_di.commands.fuzz import export_folder

    first = [export_folder(tmp_path, number, uri) for number, uri in enumerate(["models:/a/1", "b.onnx"])]
    assert [p.name for p in first] == ["01-models_a_1", "02-b.onnx"]
    for path in first:
        path.mkdir()
    again = [export_folder(tmp_path, number, uri, resume=True) for number, uri in enumerate(["b.onnx", "models:/a/1"])]
    assert again == first[::-1]
    assert export_folder(tmp_path, 2, "c[1].onnx", resume=True).name == "03-c_1_.onnx"


def test_the_old_name_of_seed_data_still_works_and_says_so(registered_cnn, tmp_path, capsys):
    from mlflow_di.cli import main

    code = main(["fuzz", "--original", registered_cnn, "--compressed", registered_cnn, "--seeds", "digits[0:3]",
                 "--num-seeds", "3", "--max-queries", "5", "--out-dir", str(tmp_path / "campaign")])
    out, err = capsys.readouterr()
    assert code == 0 and "fuzzing 3 seeds" in out
    assert err.splitlines()[0] == "mlflow-di: note: --seeds is now --seed-data; the old name will go in a later release"
    run = mlflow.search_runs(search_all_experiments=True, output_format="list",
                             filter_string="tags.`mlflow_di.command` = 'fuzz'")[0]
    assert run.data.params["seed_data"] == "digits[0:3]"  # the spec given under the old name, recorded as such
