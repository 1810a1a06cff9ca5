"""The fuzz strategy contract: a strategy is one declaration (what it needs and offers, how it runs)
and its search. A toy random search, declared here, runs through ``mlflow_di.fuzz.run`` and through
``mlflow-di fuzz --strategy`` with nothing in commands/ knowing it; what it does not offer is refused
from its declaration in one line."""
import dataclasses

import numpy as np
import pytest

from mlflow_di.cli import main
from mlflow_di.data import load_images
from mlflow_di.fuzz import Campaign, Declaration, register, run
from mlflow_di.fuzz.contract import Access
from mlflow_di.fuzz.fitness import labels_differ
from mlflow_di.fuzz.search import Search
from mlflow_di.fuzz.strategies import declaration, declarations, unregister

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class RandomSearch(Search):
    """Uniform noise of growing amplitude around the seed, one input per query."""

    def __init__(self, seed_image: np.ndarray, rng: np.random.Generator):
        super().__init__(["uniform_noise"])
        self.seed_image, self.rng, self.last = seed_image, rng, None

    def propose(self, limit=None, depth=1, out=None):
        amplitude = 8 + 4 * self.queries
        noise = self.rng.integers(-amplitude, amplitude + 1, self.seed_image.shape)
        self.last = np.clip(self.seed_image.astype(int) + noise, 0, 255).astype(np.uint8)
        return self.last[None]

    def observe(self, p_original, p_compressed):
        self.queries += 1
        if labels_differ(p_original, p_compressed)[0]:
            self._record_trigger(self.last, p_original[0], p_compressed[0], ["uniform_noise"])


@dataclasses.dataclass(frozen=True)
class RandomToy:
    name: str = "random-toy"

    def options(self) -> dict:
        return {}

    def start(self, seed_image, p_original, p_compressed, rng) -> Search:
        return RandomSearch(np.asarray(seed_image), rng)


@pytest.fixture()
def toy():
    declared = register(Declaration("random-toy", "uniform noise", RandomToy, "lockstep", budgets=(),
                                    budget_advice="it has no budget"))
    yield declared
    unregister("random-toy")


@pytest.fixture(scope="module")
def pair(trained_cnns):
    original, pruned, _ = trained_cnns
    return original.classifier(), pruned.classifier()


def test_a_declared_strategy_runs_through_the_one_entry(toy, pair):
    seeds = load_images("digits[1300:1310]")
    [result] = run(Campaign(pair[0], [pair[1]], RandomToy(), seeds, max_queries=20, batch=4, progress=False))
    assert result.config.strategy == "random-toy" and len(result.records) == 10
    assert all(r.queries <= 20 for r in result.records)
    found = [r for r in result.records if r.success]
    assert found and all(r.operators == ["uniform_noise"] for r in found)
    for trigger, record in zip(result.triggers, found):  # every trigger checked by both models
        assert pair[0].predict(trigger[None])[0] != pair[1].predict(trigger[None])[0]


def test_the_command_line_knows_a_declared_strategy_without_being_told(toy, registered_cnn, tmp_path, capsys):
    from mlflow_di.compression import compress
    from mlflow_di.models.loading import load_torch_model

    source = load_torch_model(registered_cnn)
    export = compress(source.module, source.preprocessing, "prune-l1", tmp_path / "export", amount=0.5)
    args = ["fuzz", "--original", registered_cnn, "--compressed", str(export.path), "--seed-data", "digits[1300:1306]",
            "--strategy", "random-toy", "--max-queries", "10", "--out-dir", str(tmp_path / "c")]
    assert main(args) == 0, capsys.readouterr().err
    assert "fuzzing 6 seeds with random-toy" in capsys.readouterr().out
    # refused from its declaration: no realism budget, no overlap, no Ray
    for extra, fragment in ((["--max-linf", "20"], "not random-toy; it has no budget"),
                            (["--overlap"], "--overlap applies to the black-box strategies; random-toy"),
                            (["--workers", "2"], "random-toy runs in this process")):
        assert main([*args[:-2], "--out-dir", str(tmp_path / "d"), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err


def test_every_built_in_strategy_declares_what_it_needs():
    names = {d.name: d for d in declarations()}
    assert names["boundary"].original is Access.WHITE_BOX and names["boundary"].compressed is Access.BLACK_BOX
    assert names["deepxplore"].joint and names["deepxplore"].option_prefix == "dx" and not names["deepxplore"].budgets
    assert all(d.distributed and d.overlap for d in declarations() if d.run == "lockstep")
    assert declaration("dflare").make().name == "dflare"


#: a value outside each kind of setting's declared range, and one inside it, as Python and the command line give them
_OUTSIDE = {"float": (-1.0, "-1"), "int": (0, "0"), "choice": ("fog", "fog"), "floats": ((-1.0,), "-1"),
            "pair": ((-1, 5), "-1,5")}


@pytest.mark.parametrize("spec", [s for s in declaration("deepxplore").options if s.kind != "flag"],
                         ids=lambda s: s.field)
def test_a_strategys_settings_are_checked_from_one_table(spec, capsys):
    """DeepXplore's --dx-* options and the checks of a DeepXplore made in Python read one table: a value
    outside a setting's declared range is refused on both sides, in one line."""
    from mlflow_di.errors import UserError
    from mlflow_di.fuzz.deepxplore import DeepXplore

    python_value, typed = _OUTSIDE[spec.kind]
    with pytest.raises(UserError, match=spec.field if spec.kind != "pair" else spec.what):
        DeepXplore(**{spec.field: python_value})
    flag = f"--dx-{spec.field.replace('_', '-')}"
    assert main(["fuzz", "--original", "a.onnx", "--compressed", "b.onnx", "--seed-data", "digits",
                 "--strategy", "deepxplore", flag, typed]) == 2
    assert flag in capsys.readouterr().err
