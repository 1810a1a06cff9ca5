"""The papers' figures the report compares with, and where each came from.

Only figures found in the papers' text (via the project's notes in ../shared/notes) are given as
numbers; where a table's figures could not be found, the paper's stated trend is given instead
and the report says so. DeepImportance's attack hyperparameters come from its project page
(DeepImportance/deepimportance.github.io, index.md) and its released code.
"""
from __future__ import annotations

IDC_SOURCE = ("Gerasimou, Eniser, Sen, Cakan: Importance-Driven Deep Learning System Testing, ICSE 2020; "
              "figures as quoted in ../shared/notes/deepimportance.md")
DFLARE_SOURCE = ("Tian et al.: Finding Deviated Behaviors of the Compressed DNN Models for Image Classifications, "
                 "TOSEM; figures as quoted in ../shared/notes/dflare.md")

#: IDC on the original test set U_O (MNIST, penultimate layer), percent. Paper Table 3.
IDC_UO = {
    ("LeNet1", "idc_6"): 34.6, ("LeNet4", "idc_6"): 58.8, ("LeNet5", "idc_6"): 47.0,
    ("LeNet5", "idc_8"): 28.0, ("LeNet5", "idc_10"): 9.5, ("LeNet5", "idc_12"): 4.4,
}

#: The classic criteria on U_O, percent: the paper's Table 4 row for LeNet-5 (the others' rows were not found).
CLASSIC_UO = {"LeNet5": {"nc": 75.3, "kmnc": 69.2, "nbc": 7.6, "snac": 13.8, "tknc": 88.8, "lsc": 13.8, "dsc": 54.9}}

IDC_TRENDS = {
    "idc_rq1": "perturbing the most relevant pixels changes the important neurons' activations more than "
               "those of random neurons of the same layer (Table 2; its per-model figures were not found)",
    "idc_rq2": "U_O+DI raises IDC more than U_O+S; IDC falls steeply as m grows (LeNet-5: 47.0% -> 28.0% -> "
               "9.5% -> 4.4% for m = 6, 8, 10, 12). The other criteria's Table 3 figures were not found",
    "idc_classic": "LeNet-5 on U_O: NC 75.3, KMNC 69.2, NBC 7.6, SNAC 13.8, TKNC 88.8, LSC 13.8, DSC 54.9 (Table 4's "
                   "U_O row as quoted in the notes; the other models' rows were not found)",
    "idc_rq3": "adding adversarial inputs (FGSM, BIM, JSMA, C&W) raises IDC more than adding Gaussian-noise inputs "
               "(Table 4; its figures were not found)",
    "idc_rq5": "deeper layers give higher IDC than shallow ones (Table 5; its figures were not found)",
    "idc_rq6": "(not in the paper; the project site's RQ6 as described in issue #13) augmenting the training set with "
               "inputs that raise IDC, rather than the same number of randomly perturbed inputs, should make the "
               "retrained model more robust on perturbed inputs; no figures to compare with",
}

#: DFlare Table 4: per-pair figures where the paper gives them, else its averages over the 21 pairs.
DFLARE_TABLE4 = {
    ("lenet1-tflite", "dflare-paper"): "100%, 83.97 queries, 0.513 s",
    ("lenet5-tflite", "dflare-paper"): "100%, 117.02 queries, 0.706 s",
}
DFLARE_AVERAGES = {
    "dflare-paper": "100% on all 21 pairs; 24.99 queries, 0.518 s on average",
    "dflare-paper-d": "(no working no-novelty row: the paper's DFlare_D is dflare-d-bug)",
    "dflare-d-bug": "DFlare_D: 83% success on average; ~55x DFlare's queries",
    "dflare-paper-r": "~1.05x DFlare's queries",
    "dflare": "(not in the paper: mlflow-di's log-margin DFlare)",
    "diffchaser": "74%-99.9% success; 3,642 queries, 52 s on average",
}
DFLARE_RQ4 = ("time and queries to the first deviation fall as more weights are mutated; "
              "Pearson's r about -0.97 (per-x figures not found)")
