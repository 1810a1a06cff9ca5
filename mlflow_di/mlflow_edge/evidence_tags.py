"""Where a compress run's figures were measured, as the run's tags: the evaluation data's spec, its
role (``held-out``; ``search`` when a bounded search chose the export on it; ``calibration`` or
``training``), how many of its images are calibration images, and a bounded search's held-out data.
``mlflow-di compress`` writes them (:func:`evidence_tags`, :func:`searched_on`) and says in one line
when its figures are not held-out ones (:func:`evidence_line`); the gate reads them
(:mod:`~mlflow_di.mlflow_edge.gate_evidence`) and judges figures measured on calibration or training
images only when told to.
"""
from __future__ import annotations

from mlflow_di.mlflow_edge.registry import TAG_PREFIX

EVIDENCE_DATA, EVIDENCE_ROLE, EVIDENCE_SHARED = (f"{TAG_PREFIX}evidence.data", f"{TAG_PREFIX}evidence.role",
                                                 f"{TAG_PREFIX}evidence.shared_with_calibration")
EVIDENCE_HELD_OUT = f"{TAG_PREFIX}evidence.held_out_data"


def evidence_tags(eval_data: str | None, raw_calib, raw_eval) -> dict:
    """The provenance tags of the figures: which data, and whether it is held out, the calibration
    set (no --eval-data, or evaluation images that are calibration images too) or a training split."""
    from mlflow_di.data import is_training_split, shared_images

    if raw_eval is None:
        return {}
    shared = len(raw_eval) if raw_eval is raw_calib else (shared_images(raw_calib, raw_eval) if raw_calib is not None
                                                           else 0)
    role = "calibration" if shared else "training" if is_training_split(eval_data or "") else "held-out"
    return {EVIDENCE_DATA: raw_eval.name, EVIDENCE_ROLE: role, EVIDENCE_SHARED: str(shared)}


def searched_on(tags: dict, held_out_data: str) -> dict:
    """The provenance tags when a bounded search chose the export on the evaluation data: its figures are the
    search's (role ``search``, unless calibration images make them worse), the held-out data's are judged."""
    role = tags.get(EVIDENCE_ROLE, "held-out")
    return {**tags, EVIDENCE_HELD_OUT: held_out_data, EVIDENCE_ROLE: "search" if role == "held-out" else role}


def evidence_line(tags: dict) -> str:
    """One sentence on figures measured on calibration or training data (the gate does not judge them);
    "" for held-out figures."""
    if tags.get(EVIDENCE_ROLE, "held-out") == "held-out":
        return ""
    data, shared = tags[EVIDENCE_DATA], int(tags.get(EVIDENCE_SHARED, 0))
    what = f"shares {shared} images with the calibration data" if shared else "is a training split"
    return (f"accuracy and disagreement figures are measured on {data}, which {what}, not held-out data: the gate "
            "does not judge them; pass --eval-data with images the export was neither calibrated nor trained on")
