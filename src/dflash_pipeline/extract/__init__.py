"""Capture the target's hidden states at the configured layers for every real token of a shard.

The ``extract`` job at GPU speed (issue #6):

1. Only real tokens are computed: samples arrive sorted by length and are cut into batches of at most
   ``tokens_per_batch`` padded tokens (``length_batches``); on a ShareGPT-like length mix more than 98 %
   of the computed tokens are real (``real_token_share``, logged per shard). Batches are right-padded and
   run **without** an attention mask: in a causal decoder a real token only sees positions before it, so
   padding after the last real token cannot change it (attention, the Gated-DeltaNet recurrence and its
   causal short convolution alike), and without a mask SDPA takes its causal flash kernel and the GDN
   layers skip the padding multiply and its host sync. ``tests/test_extract_speed.py`` checks the result
   equals per-sample capture.
2. The forward stops after the last captured layer (``LayerCapture``): no later layers, norm, LM head or
   logits.
3. Overlapped I/O: the real-token rows are gathered, encoded (bf16 / fp32 / fp8 e4m3 with per-token,
   per-layer scales) and counted (the shard statistics) on the device; a side CUDA stream copies them
   (``non_blocking``) into a ring of pinned host buffers and records an event; a writer thread with a
   bounded queue waits for the event and does the chunking, hashing, compression and Zarr writes, so
   the forward of batch i+1 overlaps the copy and write of batch i. On CPU the same path runs without
   streams and pinned buffers (the writer thread still overlaps). A writer failure is raised in the
   main thread at its next hand-over (never a silently incomplete shard: ``atomic_path`` removes it).
4. Kernels (opt-in, CUDA only, ``extract.fla_kernels``): transformers 5.17's qwen3_5 / qwen3_next take
   the Gated-DeltaNet chunked rule from flash-linear-attention when it is installed, but the short
   convolution from the ``causal-conv1d`` package only, else a PyTorch ``F.conv1d`` fallback; the gated
   RMSNorm and the zero-centred RMSNorm are plain PyTorch. ``use_fla_kernels`` swaps in FLA's Triton
   ``causal_conv1d`` / ``rms_norm_gated`` / ``rms_norm`` (same math, float32 inside).

Modules: ``capture`` (1, 2), ``pipeline`` (3), ``kernels`` (4), ``job`` (``extract_shard``, ``run_extract``),
``compact_basis`` (the compact store's basis, fitted before the extract jobs: ``run_fit_basis``).
"""

from .capture import LayerCapture, batched_layer_outputs, length_batches, real_token_share
from .compact_basis import run_fit_basis
from .job import extract_shard, run_extract
from .kernels import use_fla_kernels

__all__ = [
    "LayerCapture", "batched_layer_outputs", "extract_shard", "length_batches", "real_token_share", "run_extract",
    "run_fit_basis", "use_fla_kernels",
]
