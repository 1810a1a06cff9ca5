"""IDC RQ6 (the project site's RQ6, issue #13 item 6): does augmenting the training set with inputs that
raise IDC make a retrained LeNet-5 more robust than augmenting it with as many random mutants?

1. **Guiding IDC.** IDC (top ``rq6_top_m`` neurons of the default subject layer, LeNet-5's fc2) of
   the DeepImportance LeNet-5 (``LeNet5.h5``), fitted on the first ``rq6_idc_fit`` training images.
2. **Guided set (K inputs).** :func:`mlflow_di.coverage.generation.generate` (the ``generate``
   command's engine) from ``rq6_seed_sets`` disjoint sets of ``rq6_seed_set_size`` training images
   (the first ones of the split), ``rq6_budget`` mutants each, generation seed = the set's number.
   It keeps a mutant only when LeNet-5 still gives it its seed's label and it covers an IDC
   combination the set's seeds and earlier kept inputs did not, so one run keeps at most a few
   dozen inputs; all runs' kept inputs together are the guided set, each labelled with its seed's label.
3. **Random set (K inputs).** For each guided input, one mutant of *the same seed* made of as many
   operators (drawn from the same mild operators) as the guided input's chain, redrawn until
   LeNet-5 gives it the seed's label (the same oracle), with no coverage feedback. So the two sets
   have the same size, seeds, labels, operator catalogue and chain lengths; they differ only in
   the IDC selection.
4. **Retraining.** LeNet-5 (the DeepImportance architecture) from scratch by the site's recipe
   (:func:`benchmarks.train_reference_lenets.train_model`: Adadelta lr 1.0, rho 0.95, batch 256,
   ``rq6_epochs`` epochs, cross-entropy, Keras init) on (a) the training split + guided set,
   (b) the training split + random set, (c) the training split alone, with the same training
   seeds ``rq6_train_seeds`` in every arm.
5. **Robustness.** Each model's accuracy on the first ``rq6_test_inputs`` test images: clean;
   under each robustness-suite corruption at severity ``rq6_severity`` (mean over corruptions);
   as mild mutants (one chain of 1-3 generation operators per image, no oracle: the in-distribution
   case for both augmented arms); and on the triggering inputs of a DFlare campaign
   (``dflare-paper``) on ``rq6_pair`` (the DFlare LeNet-5 vs its TFLite 8-bit version) from the
   first ``rq6_fuzz_seeds`` test images, labelled with their seeds' true labels.

Intermediate results (the generated sets, the triggers, each trained model's scores) are kept in
``<out>/idc_rq6/`` and reused when the command runs again with the same settings.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
import time

import numpy as np

from mlflow_di.data import ImageSet, load_images

from benchmarks.reproduce.config import Config
from benchmarks.reproduce.results import ExperimentResult, Log

ARMS = ("baseline", "random", "guided")
#: Every setting the numbers depend on (cache keys of the saved pieces).
SETTINGS = ("mode", "rq6_top_m", "rq6_idc_fit", "rq6_seed_sets", "rq6_seed_set_size", "rq6_budget", "rq6_epochs",
            "rq6_severity", "rq6_test_inputs", "rq6_fuzz_seeds", "rq6_fuzz_timeout", "rq6_pair", "fuzz_max_queries",
            "calibration_size", "prune_amount", "analysis_size", "test_size")
MAX_TRIES = 50


def _key(config: Config, *names: str) -> str:
    values = json.dumps({n: getattr(config, n) for n in names}, sort_keys=True, default=str)
    return hashlib.sha256(values.encode()).hexdigest()[:12]


# ------------------------------------------------------------------------------ data and models
def training_set(config: Config, subjects) -> ImageSet:
    return subjects.analysis if subjects.tiny else load_images(f"mnist-train:{config.mnist_dir}")


def test_set(config: Config, subjects) -> ImageSet:
    n = config.rq6_test_inputs
    if subjects.tiny:
        return subjects.test.subset(slice(0, n), f"{subjects.test.name}[0:{n}]")
    return load_images(f"mnist-test:{config.mnist_dir}[0:{n}]")


def guide_model(config: Config, subjects):
    """The model whose IDC guides generation and whose predictions are the oracle."""
    if subjects.tiny:
        return subjects.tiny_model
    from mlflow_di.models.keras_import import import_keras

    return import_keras("lenet5", pathlib.Path(config.shared) / "models" / "deepimportance" / "LeNet5.h5")


def train_arch(subjects) -> str:
    return "digits-cnn" if subjects.tiny else "lenet5"


def _layer_ids(idc, images: np.ndarray) -> np.ndarray:
    ids = idc.combinations(np.asarray(images))
    return np.asarray(ids[idc.layers_[0]] if isinstance(ids, dict) else ids)


# ------------------------------------------------------------------------------ augmentation sets
def apply_chain(image: np.ndarray, depth: int, operators, rng: np.random.Generator) -> np.ndarray:
    """``depth`` operators drawn from ``operators``, applied one after the other."""
    for _ in range(depth):
        image = operators[int(rng.integers(len(operators)))](image, rng)
    return image


def random_control(model, seeds: np.ndarray, labels: np.ndarray, depths: np.ndarray, operators,
                   rng: np.random.Generator) -> tuple[np.ndarray, int]:
    """One label-preserving mutant of each ``seeds[i]`` with ``depths[i]`` random operators (no coverage feedback).

    A mutant the model does not give ``labels[i]`` is redrawn (at most :data:`MAX_TRIES` times; after that
    the last draw is kept). Returns the mutants and how many inputs needed that fallback.
    """
    classifier = model.classifier()
    out = np.empty_like(seeds)
    pending = np.arange(len(seeds))
    for _ in range(MAX_TRIES):
        if not len(pending):
            break
        drawn = np.stack([apply_chain(seeds[i], int(depths[i]), operators, rng) for i in pending])
        out[pending] = drawn
        preserved = classifier.predict(drawn) == labels[pending]
        pending = pending[~preserved]
    return out, int(len(pending))


def augmentation_sets(config: Config, subjects, train: ImageSet, log: Log) -> dict:
    """The guided and random sets (images, labels, seed positions in the training split) and their generation stats."""
    from mlflow_di.coverage.generation import generate, generation_operators
    from mlflow_di.coverage.idc import ImportanceDrivenCoverage

    model = guide_model(config, subjects)
    started = time.perf_counter()
    idc = ImportanceDrivenCoverage(top_m=config.rq6_top_m, seed=0, progress=False).fit(
        model, train.subset(slice(0, config.rq6_idc_fit), f"{train.name}[0:{config.rq6_idc_fit}]"))
    fit_seconds = time.perf_counter() - started
    size = config.rq6_seed_set_size
    if config.rq6_seed_sets * size > len(train):
        raise ValueError(f"{config.rq6_seed_sets} seed sets of {size} need more than the {len(train)} training images")
    images, labels, positions, depths, per_run = [], [], [], [], []
    started = time.perf_counter()
    for number in range(config.rq6_seed_sets):
        seeds = train.subset(slice(number * size, (number + 1) * size), f"{train.name}[{number * size}:{(number + 1) * size}]")
        result = generate(idc, model, seeds, config.rq6_budget, seed=number, baseline=False)
        images.append(result.images)
        labels.append(result.labels)
        positions.append(number * size + result.seed_index)
        depths.append(np.array([len(chain.split("+")) for chain in result.operators], dtype=np.int64))
        per_run.append(result.kept)
        if (number + 1) % max(1, config.rq6_seed_sets // 10) == 0:
            log(f"idc_rq6: generation {number + 1}/{config.rq6_seed_sets}, {sum(per_run)} inputs kept")
    guided = np.concatenate(images)
    labels = np.concatenate(labels)
    positions = np.concatenate(positions)
    depths = np.concatenate(depths)
    generation_seconds = time.perf_counter() - started
    started = time.perf_counter()
    rng = np.random.default_rng([6, config.rq6_seed_sets, config.rq6_budget])
    random, fallbacks = random_control(model, np.asarray(train.images)[positions], labels, depths,
                                       generation_operators(), rng)
    random_seconds = time.perf_counter() - started
    # coverage of the guiding IDC: which combinations each set reaches
    started = time.perf_counter()
    train_ids = set(_layer_ids(idc, train.images).tolist())
    seed_ids = set(_layer_ids(idc, np.asarray(train.images)[: config.rq6_seed_sets * size]).tolist())
    guided_ids = set(_layer_ids(idc, guided).tolist()) if len(guided) else set()
    random_ids = set(_layer_ids(idc, random).tolist()) if len(random) else set()
    coverage = {
        "total": int(idc.fitted_layers_[idc.layers_[0]].total_combinations), "layer": idc.layers_[0],
        "training_split": len(train_ids), "seeds": len(seed_ids), "guided": len(guided_ids), "random": len(random_ids),
        "training_plus_guided": len(train_ids | guided_ids), "training_plus_random": len(train_ids | random_ids),
        "guided_outside_training": len(guided_ids - train_ids), "random_outside_training": len(random_ids - train_ids),
        "seconds": time.perf_counter() - started}
    stats = {"K": int(len(guided)), "kept_per_run": per_run, "depths": np.bincount(depths, minlength=4)[1:].tolist(),
             "random_fallbacks": fallbacks, "fit_seconds": fit_seconds, "generation_seconds": generation_seconds,
             "random_seconds": random_seconds, "coverage": coverage}
    return {"guided": guided, "random": random, "labels": labels, "positions": positions, "stats": stats}


def _cached_sets(config: Config, subjects, train: ImageSet, folder: pathlib.Path, log: Log) -> dict:
    path = folder / f"sets-{_key(config, *SETTINGS)}.npz"
    if path.is_file():
        saved = np.load(path, allow_pickle=False)
        log(f"idc_rq6: reusing the generated sets in {path}")
        return {"guided": saved["guided"], "random": saved["random"], "labels": saved["labels"],
                "positions": saved["positions"], "stats": json.loads(str(saved["stats"]))}
    sets = augmentation_sets(config, subjects, train, log)
    np.savez_compressed(path, guided=sets["guided"], random=sets["random"], labels=sets["labels"],
                        positions=sets["positions"], stats=json.dumps(sets["stats"]))
    return sets


# ------------------------------------------------------------------------------ evaluation sets
def corrupted_sets(config: Config, test: ImageSet) -> dict[str, np.ndarray]:
    from mlflow_di.robustness.corruptions import CORRUPTIONS, corrupt

    return {name: corrupt(np.asarray(test.images), name, config.rq6_severity) for name in CORRUPTIONS}


def mutated_test(test: ImageSet) -> np.ndarray:
    """One chain of 1-3 generation operators per test image (seeded; no oracle)."""
    from mlflow_di.coverage.generation import generation_operators

    operators = generation_operators()
    rng = np.random.default_rng([6, 1])
    return np.stack([apply_chain(image, int(rng.integers(1, 4)), operators, rng) for image in np.asarray(test.images)])


def dflare_triggers(config: Config, subjects, folder: pathlib.Path, log: Log) -> dict:
    """Triggers of one DFlare campaign on ``rq6_pair`` with their seeds' true labels (kept on disk)."""
    key = _key(config, "mode", "rq6_fuzz_seeds", "rq6_fuzz_timeout", "rq6_pair", "fuzz_max_queries", "calibration_size",
               "prune_amount")
    path = folder / f"triggers-{key}.npz"
    if path.is_file():
        saved = np.load(path, allow_pickle=False)
        log(f"idc_rq6: reusing the DFlare triggers in {path}")
        return {"triggers": saved["triggers"], "seeds": saved["seeds"], "labels": saved["labels"],
                "stats": json.loads(str(saved["stats"]))}
    from mlflow_di.fuzz.campaign import run_campaign

    from benchmarks.reproduce.dflare_variants import harness_strategy

    seeds = subjects._first_images(config.rq6_fuzz_seeds)
    pair = subjects.pair(config.rq6_pair)
    log(f"idc_rq6: DFlare (dflare-paper) on {config.rq6_pair}, {len(seeds)} seeds")
    started = time.perf_counter()
    result = run_campaign(pair.original, pair.compressed, seeds, strategy=harness_strategy("dflare-paper"),
                          timeout=config.rq6_fuzz_timeout, max_queries=config.fuzz_max_queries, seed=0, progress=False)
    labels = np.asarray(seeds.labels)[result.trigger_indices]
    summary = result.summary
    stats = {"pair": config.rq6_pair, "description": pair.description, "seeds": len(seeds),
             "fuzzed": summary.fuzzed, "already_deviating": summary.already_deviating, "triggers": int(len(labels)),
             "success_rate": summary.success_rate, "mean_queries": summary.mean_queries,
             "seconds": time.perf_counter() - started}
    np.savez_compressed(path, triggers=result.triggers, seeds=result.trigger_seeds, labels=labels,
                        stats=json.dumps(stats))
    return {"triggers": result.triggers, "seeds": result.trigger_seeds, "labels": labels, "stats": stats}


def scores(model, test: ImageSet, corrupted: dict, mutants: np.ndarray, triggers: dict) -> dict:
    classifier = model.classifier()
    labels = np.asarray(test.labels)

    def accuracy(images, truth) -> float:
        return float(np.mean(classifier.predict(images) == truth)) if len(truth) else float("nan")

    per_corruption = {name: accuracy(images, labels) for name, images in corrupted.items()}
    return {"clean": accuracy(test.images, labels), "corrupted": float(np.mean(list(per_corruption.values()))),
            "per_corruption": per_corruption, "mutants": accuracy(mutants, labels),
            "triggers": accuracy(triggers["triggers"], triggers["labels"]),
            "trigger_seeds": accuracy(triggers["seeds"], triggers["labels"])}


# ------------------------------------------------------------------------------ the experiment
def run(config: Config, subjects, log: Log, out: pathlib.Path | None = None) -> ExperimentResult:
    from benchmarks.train_reference_lenets import train_model

    folder = (out or subjects.work_dir) / "idc_rq6"
    folder.mkdir(parents=True, exist_ok=True)
    train = training_set(config, subjects)
    test = test_set(config, subjects)
    sets = _cached_sets(config, subjects, train, folder, log)
    stats = sets["stats"]
    log(f"idc_rq6: K = {stats['K']} guided and as many random inputs; coverage {stats['coverage']}")
    started = time.perf_counter()
    corrupted = corrupted_sets(config, test)
    mutants = mutated_test(test)
    eval_seconds = time.perf_counter() - started
    triggers = dflare_triggers(config, subjects, folder, log)
    guide = guide_model(config, subjects)
    reference = scores(guide, test, corrupted, mutants, triggers)
    base_images, base_labels = np.asarray(train.images), np.asarray(train.labels)
    training = {
        "baseline": (base_images, base_labels),
        "random": (np.concatenate([base_images, sets["random"]]), np.concatenate([base_labels, sets["labels"]])),
        "guided": (np.concatenate([base_images, sets["guided"]]), np.concatenate([base_labels, sets["labels"]])),
    }
    rows = []
    for seed in config.rq6_train_seeds:
        for arm in ARMS:
            path = folder / f"model-{arm}-seed{seed}-{_key(config, *SETTINGS)}.json"
            if path.is_file():
                rows.append(json.loads(path.read_text()))
                log(f"idc_rq6: reusing {arm} seed {seed}")
                continue
            images, labels = training[arm]
            log(f"idc_rq6: training {train_arch(subjects)} ({arm}, {len(labels):,} inputs, seed {seed})")
            started = time.perf_counter()
            model, losses = train_model(train_arch(subjects), seed, "cpu", images, labels, epochs=config.rq6_epochs)
            seconds = time.perf_counter() - started
            row = {"arm": arm, "seed": seed, "train_inputs": int(len(labels)), "final_loss": float(losses[-1]),
                   "train_seconds": seconds, **scores(model, test, corrupted, mutants, triggers)}
            path.write_text(json.dumps(row))
            rows.append(row)
            log(f"idc_rq6: {arm} seed {seed}: clean {row['clean']:.4f}, corrupted {row['corrupted']:.4f}, "
                f"mutants {row['mutants']:.4f}, triggers {row['triggers']:.4f} ({seconds:.0f} s)")
    meta = {"K": stats["K"], "generation": stats, "triggers": triggers["stats"], "reference_model": reference,
            "train_inputs": len(train), "test_inputs": len(test), "train_data": train.name, "test_data": test.name,
            "arch": train_arch(subjects), "eval_set_seconds": eval_seconds,
            "guide": "the tiny digits CNN" if subjects.tiny else "the DeepImportance LeNet-5, LeNet5.h5,",
            "corruptions": sorted(corrupted), "severity": config.rq6_severity}
    return ExperimentResult("idc_rq6", rows, meta, config.to_dict())
