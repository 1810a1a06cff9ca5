"""DeepXplore's own settings, declared once: the ``--dx-*`` options of ``mlflow-di fuzz`` and the checks of a
:class:`~mlflow_di.fuzz.deepxplore.DeepXplore` made in Python both read this table (a module of its own, so
that declaring the strategy does not import its search)."""
from __future__ import annotations

from mlflow_di.settings import OptionSpec

#: DeepXplore's own options (``--dx-*``), fields of :class:`~mlflow_di.fuzz.deepxplore.DeepXplore`: its one
#: constraints table (the command line's options and the object's own checks read it)
DEEPXPLORE_OPTIONS = (
    OptionSpec("constraint", "lighting (default: every pixel alike), occlusion (one rectangle) or blackout (small "
               "rectangles, only darker).", "choice", choices=("lighting", "occlusion", "blackout")),
    OptionSpec("step", "8-bit levels per unit of normalised gradient (default 2550: the reference MNIST script's "
               "s = 10 on 0..1 pixels).", "float", low=0, open=(True, False)),
    OptionSpec("lambda1", "Weight of the target model's confidence (default 1).", "float", low=0),
    OptionSpec("lambda2", "Weight of the not-yet-covered neuron's activation (default 0.1).", "float", low=0),
    OptionSpec("threshold", "NC threshold on the layer-scaled activation (default 0).", "float", low=0, high=1,
               open=(False, True)),
    OptionSpec("iterations", "Gradient steps per climb (default 20, the reference's).", "int", low=1),
    OptionSpec("retarget", "Climb again toward each other model when a climb fails (default on).", "flag"),
    OptionSpec("finer_steps", "Then climb again with each of these steps (default 255).", "floats", what="step",
               example="255"),
    OptionSpec("occlusion_at", "Occlusion: top-left corner (default 0,0).", "pair", low=0, what="occlusion position",
               example="0,0", metavar="ROW,COL"),
    OptionSpec("occlusion_size", "Occlusion: the rectangle's size (default 10,10, the reference's).", "pair", low=1,
               what="occlusion size", example="10,10"),
    OptionSpec("blackout_size", "Blackout: each rectangle's size (default 6,6, the reference's).", "pair", low=1,
               what="blackout size", example="6,6"),
    OptionSpec("blackout_count", "Blackout: rectangles a step (default 1).", "int", low=1, metavar="N"),
)
