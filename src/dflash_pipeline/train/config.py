"""The ``train:`` section of the workflow config as the trainer takes it. Its defaults are config/schema.yaml's
(the one source; ``tests/test_config_defaults.py`` checks that they agree): the paper's recipe for GPUs, except
where a measurement changed them (Muon; config/README.md, "The training recipe")."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from ..config import RUNTIME_KEYS as SECTION_RUNTIME_KEYS

# Keys that change how fast training runs, never what it computes: not part of the resume fingerprint.
RUNTIME_KEYS = SECTION_RUNTIME_KEYS["train"]


@dataclasses.dataclass
class TrainConfig:
    """The ``train:`` section (config/README.md describes each key)."""

    gpus: int = 1
    threads: int = 4
    epochs: int = 6
    steps: int | None = None  # optimizer steps of the run, epochs walked as needed (None: epochs x steps per epoch)
    lr: float = 6e-4
    weight_decay: float = 0.0
    warmup_ratio: float = 0.04
    grad_clip: float = 1.0
    max_anchors: int = 512
    val_max_anchors: int | None = None
    tokens_per_batch: int = 32768
    block_size: int = 16
    num_layers: int = 5
    head_dim: int | None = None
    num_attention_heads: int | None = None  # architecture keys: None = the rule (drafter/config.py)
    num_key_value_heads: int | None = None
    intermediate_size: int | None = None
    layer_types: list[str] | None = None
    sliding_window: int | None = None
    rope_theta: float | None = None
    rope_scaling: dict | None = None
    is_causal: bool | None = None
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = "dflash"  # or "dflash2" (drafter/dflash2.py) with the four keys below (None: published)
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    selector_loss_weight: float = 1.0  # dflash2: weight of the selector's K-way cross-entropy in the loss
    gamma: float | None = None
    mask_token_id: int | None = None
    val_fraction: float = 0.02
    seed: int = 0
    num_workers: int = 4
    prefetch_factor: int = 2
    checkpoint_every: int = 500
    gradient_checkpointing: bool = False
    compile: bool = True
    compile_layers: bool = False  # with compile: each decoder layer's pass compiled whole, not only its pointwise parts
    flex_kernel_options: dict | None = None  # FlexAttention's kernel_options in training (None: its defaults)
    export_dtype: str = "float32"
    snapshots: list[int] | None = None  # percent of all steps at which the drafter is also exported
    max_samples: int | None = None  # a seeded subset of the training split (None: all of it)
    optimizer: str = "muon"  # or "adamw"; muon: torch.optim.Muon on the draft layers' and fc's 2-D weights
    muon_lr: float = 0.02
    preload: bool | str = "auto"  # the store in the device's memory: true, false or auto (when it fits)
    compile_cache: str | None = None  # TORCHINDUCTOR_CACHE_DIR / TRITON_CACHE_DIR for torch.compile's caches
    coefficients: bool = True  # a compact store: fc' = fc U over its coefficients (compact_fc.coefficient_fc)
    log_every: int | None = None  # steps between log lines (and host reads of the losses); None: 1 % of them

    def __post_init__(self):
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"train.steps {self.steps}: expected a number of optimizer steps >= 1, or null for "
                             f"train.epochs of them")


def seeded(*key) -> torch.Generator:
    """A generator seeded by a tuple (e.g. (seed, epoch, sample)): the same draw in any process."""
    return torch.Generator().manual_seed(int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(),
                                                        "little") >> 1)
