"""The ``compact_basis`` job (issue #34): the compact store's basis (``store/compact.py``), fitted once on a sample of
the first tokenised shard before any extract job, so that every shard is encoded with the same one."""

from __future__ import annotations

import numpy as np
import torch

from ..atomic import atomic_path
from ..store.compact import Basis, BasisFit, default_rank
from ..store.compact_codec import write_basis
from ..target import load_target, resolve_layer_ids
from ..tokenization import read_tokenized
from .capture import LayerCapture, batched_layer_outputs


def run_fit_basis(tokenized_path, out_path, *, target: str, revision, trust_remote_code: bool, dtype: str,
                  settings: dict, device: str | None = None, random_weights_seed: int | None = None) -> Basis:
    """Fit the basis on a seeded sample of ``extract.compact.fit_tokens`` tokens of the first tokenised shard
    (whole samples, drawn at random: the shard is sorted by length) and write it atomically (``write_basis``)."""
    options = settings["compact"]
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = load_target(target, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code,
                        random_weights_seed=random_weights_seed)
    text = model.config.get_text_config()
    layer_ids = resolve_layer_ids(settings["layer_ids"], settings["num_layers"], text.num_hidden_layers)
    frame = read_tokenized(tokenized_path)
    order = np.random.default_rng(0).permutation(len(frame))
    taken = order[: int(np.searchsorted(np.cumsum(frame["num_tokens"].to_numpy()[order]), options["fit_tokens"])) + 1]
    samples = [frame["input_ids"].iloc[i] for i in sorted(taken, key=lambda i: frame["num_tokens"].iloc[i])]
    fit = BasisFit(len(layer_ids), text.hidden_size, weighting=options["weighting"], per_layer=options["per_layer"],
                   device=device)
    for outputs, lengths in batched_layer_outputs(LayerCapture(model, layer_ids), samples,
                                                  settings["tokens_per_batch"], device):
        width = outputs[0].shape[1]
        real = torch.from_numpy(np.flatnonzero(np.arange(width)[None, :] < lengths[:, None])).to(device)
        fit.add(torch.stack([o.reshape(-1, o.shape[-1]).index_select(0, real) for o in outputs], dim=1))
    rank = options["rank"] or default_rank(len(layer_ids), text.hidden_size)
    basis = fit.fit(rank)
    with atomic_path(out_path) as tmp:
        write_basis(basis, tmp)
    return basis
