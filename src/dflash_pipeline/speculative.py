"""Speculative decoding with a block drafter and target verification (docs/design.md, "DFlash, precisely").

Invariant of the loop: ``tokens`` = prompt + committed output; the last committed token is the *anchor*,
not yet fed to the target, so the target's cache holds positions 0..len(tokens)-2 and the proposer has
been given the features of exactly those positions. One step:

1. the proposer drafts B-1 tokens for the block [anchor, d_1 .. d_{B-1}] at positions n-1 .. n+B-2;
2. the target runs the block in one forward (logits and the captured layer features of all B slots);
3. a = number of leading drafts the target agrees with (greedy: equal to its argmax; sampling: the
   lossless min(1, p/q) rule); the step commits d_1..d_a plus the target's own next token (the bonus),
   cut after an EOS and at ``max_new_tokens``;
4. the features of the anchor and the accepted drafts become new drafter context, and the target's
   cache is rolled back to the committed length (``TargetSession.rollback``: the one place that knows
   how to undo a verification; attention caches crop, a hybrid target's Gated-DeltaNet states are
   restored and recomputed over the committed prefix).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import CacheLayerMixin, LinearAttentionCacheLayerMixin

from .target import decoder_layers


# ---- the target side ----
class TargetSession:
    """The target's forward passes for one generation: a KV cache plus forward hooks that capture the
    outputs of decoder layers ``layer_ids`` (id x = output of decoder layer x = hidden_states[x+1]).

    Hybrid targets (Qwen3.5/3.6, Qwen3-Next: Gated-DeltaNet layers between full-attention layers) get a
    ``DynamicCache`` whose linear-attention layers hold a conv state (the last conv-kernel-size inputs of
    the short convolution) and a recurrent state, updated in place and with no sequence axis: transformers
    cannot crop them (``crop`` raises; ``get_seq_length`` reads the first attention layer). For them
    every ``forward`` (except ``last_only`` ones: a prefill verifies nothing) keeps a snapshot of those
    states and the inputs of each Gated-DeltaNet mixer, so that ``rollback`` can undo it exactly."""

    def __init__(self, model: nn.Module, layer_ids: list[int] | None):
        self.model, self.layer_ids = model, list(layer_ids or [])
        self.cache = DynamicCache(config=model.config)
        self.device = next(model.parameters()).device
        self._outputs: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)
        if self.layer_ids and max(self.layer_ids) >= len(layers):
            raise ValueError(f"layer ids {self.layer_ids} out of range for a target of {len(layers)} layers")
        self._handles = [layers[i].register_forward_hook(self._hook(i)) for i in set(self.layer_ids)]
        # hybrid targets: cache layer index -> the Gated-DeltaNet mixer that owns its states
        self._mixers = _linear_attention_mixers(layers, self.cache)
        self._snapshot: tuple[int, dict[int, dict]] | None = None  # (length before the latest forward, states)
        self._mixer_inputs: dict[int, torch.Tensor] = {}
        self._recording = False
        self._handles += [mixer.register_forward_pre_hook(self._input_hook(i), with_kwargs=True)
                          for i, mixer in self._mixers.items()]

    def _hook(self, index: int):
        def hook(module, args, output):
            self._outputs[index] = output[0] if isinstance(output, tuple) else output

        return hook

    def _input_hook(self, index: int):
        def hook(module, args, kwargs):
            if self._recording:
                self._mixer_inputs[index] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]

        return hook

    @property
    def hybrid(self) -> bool:
        """Whether the target has linear-attention (recurrent) cache layers."""
        return bool(self._mixers)

    @property
    def length(self) -> int:
        return self.cache.get_seq_length()

    @torch.no_grad()
    def forward(self, token_ids: list[int], *, last_only: bool = False):
        """Run ``token_ids`` after the cached positions -> (float32 logits [S or 1, V], features [S, K*D] or
        None: the captured layers concatenated in ``layer_ids`` order, the layout ``fuse_context`` takes)."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        logits, features = self.forward_batch(ids, last_only=last_only)
        return logits[0], features[0] if features is not None else None

    @torch.no_grad()
    def forward_batch(self, ids: torch.Tensor, *, last_only: bool = False, **model_kwargs):
        """``forward`` of R rows ``ids`` [R, S] that each continue the cached sequence (R > 1: the cache is
        repeated R times, after the snapshot), with extra model arguments (a 4D ``attention_mask``,
        ``position_ids``) -> (float32 logits [R, S or 1, V], features [R, S, K*D] or None)."""
        self._outputs.clear()
        if self.hybrid:
            self._mixer_inputs.clear()
            self._snapshot = None if last_only else (self.length, self._linear_states())
            self._recording = not last_only
        if ids.shape[0] > 1:
            self.cache.reorder_cache(torch.zeros(ids.shape[0], dtype=torch.long, device=self.device))
        try:
            out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1 if last_only else 0, **model_kwargs)
        finally:
            self._recording = False
        features = torch.cat([self._outputs[i] for i in self.layer_ids], dim=-1) if self.layer_ids else None
        self._outputs.clear()
        return out.logits.float(), features

    @torch.no_grad()
    def rollback(self, length: int) -> None:
        """Forget every cached position >= ``length``: the only place that undoes a verification.

        Attention KV caches crop (a negative count). A hybrid target's linear-attention layers cannot:
        their states are put back to the snapshot taken before the latest ``forward`` and advanced over the
        positions kept, by re-running each Gated-DeltaNet mixer on the inputs it received for them in that
        forward (the inputs of causal layers at kept positions do not depend on the positions dropped, so
        this is the state the target would have after running just the kept tokens). Only the mixers run
        again: no MLP, attention or LM head, and the capture hooks do not fire. A hybrid target can
        therefore only roll back to a length inside its latest non-``last_only`` forward."""
        extra = self.length - length
        if extra < 0:
            raise ValueError(f"cannot roll back a cache of {self.length} positions to {length}")
        if not extra:
            return
        if not self.hybrid:
            self.cache.crop(-extra)
            return
        if self._snapshot is None or length < self._snapshot[0]:
            start = "none" if self._snapshot is None else self._snapshot[0]
            raise ValueError(f"a hybrid target can roll back only inside its latest forward (from {start} "
                             f"positions): cannot roll back {self.length} positions to {length}")
        start, states = self._snapshot
        for index, layer in enumerate(self.cache.layers):
            if index in self._mixers:
                _restore(layer, states[index])
            else:
                layer.crop(-extra)
        if length > start:
            for index, mixer in self._mixers.items():
                mixer(hidden_states=self._mixer_inputs[index][:, : length - start], cache_params=self.cache)

    def _linear_states(self) -> dict[int, dict]:
        """A copy of every linear-attention cache layer's conv/recurrent states and flags."""
        states = {}
        for index in self._mixers:
            layer = self.cache.layers[index]
            states[index] = {
                name: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in getattr(layer, name).items()}
                for name in _LINEAR_STATE_FIELDS}
        return states

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._snapshot, self._mixer_inputs = None, {}


# what a linear-attention cache layer (transformers' LinearAttentionCacheLayerMixin) holds per state index
_LINEAR_STATE_FIELDS = ("conv_states", "recurrent_states", "is_conv_states_initialized",
                        "is_recurrent_states_initialized", "has_previous_state")


def _restore(layer, saved: dict) -> None:
    """Put a linear-attention cache layer back to ``saved`` (copies: the layer updates its states in place)."""
    for name in _LINEAR_STATE_FIELDS:
        setattr(layer, name, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in saved[name].items()})


def _linear_attention_mixers(layers: nn.ModuleList, cache) -> dict[int, nn.Module]:
    """Cache layer index -> the Gated-DeltaNet module of that decoder layer, for every linear-attention
    layer of ``cache`` (empty for an attention-only target). Cache layers that mix linear and KV states,
    or linear layers without a Gated-DeltaNet mixer, are refused: ``rollback`` would not be exact."""
    mixers = {}
    for index, layer in enumerate(cache.layers):
        if not isinstance(layer, LinearAttentionCacheLayerMixin):
            continue
        found = [m for m in layers[index].children() if type(m).__name__.endswith("GatedDeltaNet")]
        if isinstance(layer, CacheLayerMixin) or len(found) != 1:
            raise NotImplementedError(f"cache layer {index} ({type(layer).__name__}) of this target: speculative "
                                      "decoding can roll back only attention layers and Gated-DeltaNet layers")
        mixers[index] = found[0]
    return mixers


# ---- proposers ----
class Proposer:
    """Drafts B-1 tokens for the block anchored at the last committed token.

    ``layer_ids``: the target layers whose features ``propose`` wants (None: no features are captured).
    ``propose`` gets all committed tokens and the features of the positions added to the target's cache
    since its previous call (the whole prompt on the first call), and returns the drafts (LongTensor
    [B-1]) and, for sampling, their distributions q (float [B-1, V], or None: a deterministic proposer,
    q = one-hot of the draft)."""

    block_size: int
    layer_ids: list[int] | None = None

    def start(self, prompt_ids: list[int]) -> None:
        """Reset any per-generation state."""

    def propose(self, tokens: list[int], features: torch.Tensor | None, *, temperature: float = 0.0,
                generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError


class DFlashProposer(Proposer):
    """The DFlash drafter (``drafter``) with an incremental ``ContextCache`` of its projected context: the argmax (or,
    sampling, a draw from the softmax) of each slot's logits. Given a DFlash2 drafter it drafts from the backbone
    alone (its selector unused): the "backbone drafts" that ``DFlash2Proposer``'s are compared with."""

    def __init__(self, drafter):
        from .drafter import ContextCache

        self.drafter, self._cache_type = drafter.eval(), ContextCache
        self.block_size = drafter.config.block_size
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.cache = None

    def start(self, prompt_ids):
        self.cache = self._cache_type()

    @torch.no_grad()
    def block_hidden(self, tokens, features) -> torch.Tensor:
        """One drafter pass over the block anchored at ``tokens[-1]`` -> final-normed hidden [B-1, D] of the drafted
        slots (the context cache takes ``features``)."""
        device = self.drafter.fc.weight.device
        block = torch.full((1, self.block_size), self.drafter.mask_token_id, dtype=torch.long, device=device)
        block[0, 0] = tokens[-1]
        h = self.drafter.forward_block(features[None].to(device), block, len(tokens) - 1, cache=self.cache)
        return h[0, 1:]

    @torch.no_grad()
    def block_logits(self, tokens, features) -> torch.Tensor:
        """The per-slot logits (float [B-1, V]) of one drafter pass: what a tree over the block is built from (a
        DFlash2 drafter's are its backbone's, before the selector)."""
        return self.drafter.logits(self.block_hidden(tokens, features)).float()

    @torch.no_grad()
    def propose(self, tokens, features, *, temperature=0.0, generator=None):
        logits = self.block_logits(tokens, features)
        if temperature <= 0:
            return logits.argmax(-1), None
        q = torch.softmax(logits / temperature, dim=-1)
        return torch.multinomial(q, 1, generator=generator)[:, 0], q


class DFlash2Proposer(DFlashProposer):
    """A DFlash2 drafter: the candidate selector's walk through the top-K of each slot's logits, from the anchor.
    Sampling: each slot's draft is drawn from the walk's K-way distribution, and q is that distribution over the
    vocabulary (zero outside the K candidates), so that ``sampling_accept`` stays lossless."""

    @torch.no_grad()
    def propose(self, tokens, features, *, temperature=0.0, generator=None):
        hidden = self.block_hidden(tokens, features)
        drafts, candidates, q_top = self.drafter.candidate_selector.walk(
            hidden, self.drafter.logits(hidden), tokens[-1], temperature, generator)
        if q_top is None:
            return drafts, None
        q = torch.zeros((candidates.shape[0], self.drafter.config.vocab_size), device=q_top.device)
        return drafts, q.scatter_(1, candidates, q_top)


def make_proposer(drafter) -> DFlashProposer:
    """The proposer of a drafter's architecture: the selector's walk for DFlash2, the argmax for DFlash."""
    return DFlash2Proposer(drafter) if drafter.config.architecture == "dflash2" else DFlashProposer(drafter)


# ---- acceptance rules ----
def greedy_accept(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[int, int]:
    """Target logits [B, V] of the block, drafts [B-1] -> (a = leading drafts equal to the target's argmax,
    the target's token after them)."""
    target = logits.argmax(-1)
    matches = (drafts.to(target.device) == target[:-1]).long()
    a = int(matches.cumprod(0).sum())
    return a, int(target[a])


def sampling_accept(logits, drafts, q, temperature: float, generator=None) -> tuple[int, int]:
    """The lossless speculative-sampling rule: draft k is accepted with prob min(1, p_k(d)/q_k(d)) (p at
    ``temperature``); the first rejection is replaced by a sample of norm(max(p_k - q_k, 0)); if all are
    accepted the bonus is sampled from p_B. q None = a deterministic proposer (q one-hot on the draft)."""
    p = torch.softmax(logits / temperature, dim=-1)
    drafts = drafts.to(p.device)
    if q is None:
        q = F.one_hot(drafts, p.shape[-1]).to(p.dtype)
    q = q.to(p.device, p.dtype)
    gen_device = generator.device if generator is not None else p.device
    for k, d in enumerate(drafts.tolist()):
        u = torch.rand((), generator=generator, device=gen_device).item()
        if u * q[k, d] < p[k, d]:  # u < p/q, without dividing by a zero q
            continue
        residual = (p[k] - q[k]).clamp_min(0)
        residual = residual if residual.sum() > 0 else p[k]
        return k, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))
    return len(drafts), int(torch.multinomial(p[-1], 1, generator=generator))


# ---- the loop ----
@dataclass
class Generation:
    """One speculative generation: output tokens and, per verify step, the drafts the target accepted
    (``accepted``, before any EOS/length cut) and the tokens the step committed (``committed``)."""

    prompt_length: int
    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)
    seconds: float = 0.0
    stopped_by: str = ""

    @property
    def tau(self) -> float:
        """Tokens committed per verify step, bonus included (the first token, from the prefill, excluded)."""
        return sum(self.committed) / len(self.committed) if self.committed else float("nan")


def eos_token_ids(model) -> set[int]:
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = model.config.get_text_config().eos_token_id
    return set(eos if isinstance(eos, (list, tuple)) else [] if eos is None else [eos])


def _sample_or_argmax(logits, temperature, generator):
    if temperature <= 0:
        return int(logits.argmax(-1))
    return int(torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1, generator=generator))


def commit(result: Generation, new: list[int], eos_ids: set[int], max_new_tokens: int) -> list[int]:
    """A verify step's tokens (accepted drafts and the target's own), cut after an EOS and at ``max_new_tokens``,
    added to ``result`` (its ``tokens`` and ``committed``) -> the tokens kept."""
    cut = next((i + 1 for i, t in enumerate(new) if t in eos_ids), len(new))
    new = new[: min(cut, max_new_tokens - len(result.tokens))]
    result.committed.append(len(new))
    result.tokens += new
    return new


@torch.no_grad()
def speculative_generate(model: nn.Module, proposer: Proposer, prompt_ids: list[int], *,
                         max_new_tokens: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                         eos_ids: set[int] | None = None) -> Generation:
    """Generate up to ``max_new_tokens`` after ``prompt_ids`` (stopping after an EOS); at temperature 0
    the output equals the target's own greedy decoding."""
    eos_ids = eos_token_ids(model) if eos_ids is None else set(eos_ids)
    prompt_ids = [int(t) for t in prompt_ids]
    result = Generation(prompt_length=len(prompt_ids))
    if max_new_tokens <= 0:
        result.stopped_by = "length"
        return result
    started = time.perf_counter()
    session = TargetSession(model, proposer.layer_ids)
    try:
        proposer.start(prompt_ids)
        logits, features = session.forward(prompt_ids, last_only=True)
        first = _sample_or_argmax(logits[-1], temperature, generator)
        result.tokens.append(first)
        tokens = prompt_ids + [first]
        B, done = proposer.block_size, first in eos_ids
        while not done and len(result.tokens) < max_new_tokens:
            drafts, q = proposer.propose(tokens, features, temperature=temperature, generator=generator)
            if drafts.shape != (B - 1,):
                raise ValueError(f"proposer returned drafts of shape {tuple(drafts.shape)}, expected ({B - 1},)")
            logits, block_features = session.forward([tokens[-1], *drafts.tolist()])
            if temperature <= 0:
                a, bonus = greedy_accept(logits, drafts)
            else:
                a, bonus = sampling_accept(logits, drafts, q, temperature, generator)
            result.accepted.append(a)
            new = commit(result, drafts[:a].tolist() + [bonus], eos_ids, max_new_tokens)
            session.rollback(len(tokens) + a)  # keep the anchor and the accepted drafts
            tokens += new
            features = block_features[: a + 1] if block_features is not None else None
            done = new[-1] in eos_ids
        result.stopped_by = "eos" if result.tokens[-1] in eos_ids else "length"
    finally:
        session.close()
    result.seconds = time.perf_counter() - started
    return result
