"""DFlash training (docs/design.md, "DFlash, precisely"), by job: ``config`` (TrainConfig), ``batches`` (the split
and the length-grouped batches), ``build`` (the drafter a run starts from), ``step`` (packed forward, gradients,
optimisers), ``trainer`` (the loop and validation), ``checkpoint`` (resume, export, the log), ``compact_fc`` (fc
over a compact store's coefficients), ``timing`` (where the time goes, ``timing.json``), ``job`` (the entry points:
``launch``, ``train``, ``python -m dflash_pipeline.train``).
"""

from .batches import LengthGroupedBatches, split_indices
from .build import build_drafter, configure_for_training
from .checkpoint import export, write_log
from .config import RUNTIME_KEYS, TrainConfig
from .job import launch, set_up_process, train
from .step import accumulate_gradients, make_optimizers, packed_forward
from .timing import DataGaps, LoopClock
from .trainer import Placement, Trainer

__all__ = [
    "RUNTIME_KEYS", "DataGaps", "LengthGroupedBatches", "LoopClock", "Placement", "TrainConfig", "Trainer",
    "accumulate_gradients", "build_drafter", "configure_for_training", "export", "launch", "make_optimizers",
    "packed_forward",
    "set_up_process", "split_indices", "train", "write_log",
]
