"""Investigation behind the DFlare Table 4 notes: does the novelty term matter under the
reference code's acceptance rule?

mlflow-di's DFlare follows the paper: a mutant x replaces x_max when H(x) >= H(x_max), with
H = D / delta + O (delta = 1e-3, O = 1 for a novel probability pair). The reference code instead
accepts x when |D(x) - D(x_max)| > delta (an increase *or* a decrease), and otherwise only when
the pair is novel. This script runs DFlare and DFlare_D (no novelty) under both rules on a DFlare
TFLite pair and prints one JSON line per campaign.

Not part of the reproduction command. The reference rule is the engine's
``DFlare(acceptance="reference")``.

    python -m benchmarks.reproduce.investigate_acceptance --arch lenet5 --seeds 100 --timeout 30
"""
from __future__ import annotations

import argparse
import collections
import json

import mlflow_di  # noqa: F401  (torchvision guard)
from mlflow_di.data import load_images
from mlflow_di.fuzz.campaign import run_campaign
from mlflow_di.fuzz.dflare import DFlare
from mlflow_di.models.loading import load_classifier

from benchmarks.reproduce.config import default_shared


STRATEGIES = {
    "paper rule, dflare": lambda: DFlare(),
    "paper rule, dflare-d": lambda: DFlare(name="dflare-d", novelty=False),
    "reference rule, dflare": lambda: DFlare(name="dflare-reference-acceptance", acceptance="reference"),
    "reference rule, dflare-d": lambda: DFlare(name="dflare-d-reference-acceptance", novelty=False,
                                               acceptance="reference"),
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="lenet5", choices=("lenet1", "lenet5"))
    parser.add_argument("--seeds", type=int, default=100)
    parser.add_argument("--timeout", type=float, default=30.0)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--variants", default=";".join(STRATEGIES), help="';'-separated keys of STRATEGIES")
    args = parser.parse_args(argv)
    shared = default_shared()
    folder = shared / "models" / "dflare"
    original = load_classifier(f"keras:{args.arch}-same:{folder / f'{args.arch}.h5'}")
    compressed = load_classifier(str(folder / f"{args.arch}-quan.lite"))
    seeds = load_images(f"mnist:{shared / 'data' / 'mnist'}[0:{args.seeds}]")
    for label in args.variants.split(";"):
        for run in range(args.runs):
            result = run_campaign(original, compressed, seeds, strategy=STRATEGIES[label](), timeout=args.timeout,
                                  seed=run, progress=False)
            summary = result.summary
            stops = collections.Counter(r.stop for r in result.records)
            print(json.dumps({"pair": args.arch, "variant": label, "run": run, "seeds": args.seeds,
                              "timeout": args.timeout, "success": summary.success_rate,
                              "mean_queries": summary.mean_queries, "median_queries": summary.median_queries,
                              "stops": dict(stops)}), flush=True)


if __name__ == "__main__":
    main()
