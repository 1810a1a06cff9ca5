"""Reproduce the key experiments of the IDC (ICSE 2020) and DFlare (TOSEM) papers with mlflow-di.

One module per experiment, each ``run(config, subjects, log) -> ExperimentResult``:

=====================  =====================================================================
``idc_rq1``            importance: activation change of important vs random neurons (Table 2)
``idc_rq2``            diversity: U_O, U_O+S, U_O+DI for IDC_m and the classic criteria (Table 3)
``idc_sensitivity``    why IDC_6 differs from the paper: LRP rule, clustering quirks, |U_O|
``idc_paper_era``      the paper-era protocol: per class, reference LRP and clustering, comb_cov.py's pairing
``idc_classic``        classic criteria: defaults, SADL's bucket rule, DeepImportance's layer set (Table 4's U_O row)
``idc_rq3``            adversarial: U_O plus FGSM/BIM/JSMA/C&W (ART) and Gaussian sets (Table 4)
``idc_rq5``            layers: IDC of every hidden layer (Table 5)
``idc_rq6``            retraining: training split + IDC-guided vs + random mutants, robustness
``dflare_table4``      DFlare, DFlare_D, DFlare_R and DiffChaser on four model pairs (Table 4)
``dflare_rq4``         dissemination: queries/time to a deviation vs % of mutated weights (RQ4)
=====================  =====================================================================

``python -m benchmarks.reproduce [--quick | --tiny] [--out DIR]`` runs them and writes the
markdown report (see :mod:`benchmarks.reproduce.__main__`).
"""

EXPERIMENTS = ("idc_rq1", "idc_rq2", "idc_paper_era", "idc_sensitivity", "idc_classic", "idc_rq3", "idc_rq5", "idc_rq6",
               "dflare_table4", "dflare_rq4")
