"""Batched greedy decoding for regeneration, through the model's own forward (issue #21).

``greedy_batch`` gives what a left-padded greedy ``generate`` gives, at less cost per decode step:

- Prefill. The left-padded batch in one forward (transformers' SDPA attention, as ``generate``), then one token
  per row and step, positions and padding mask as ``generate`` makes them.
- The KV cache. Per layer, tensors of prompt width + new tokens slots, preallocated and written in place
  (``SlotLayer``, a ``DynamicLayer`` that does not ``torch.cat``). The prefill reads the prompt's slots; a decode
  step reads all slots, the unwritten ones masked: every decode step has the same shapes.
- Decode attention (``decode_attention``, registered with transformers' ``AttentionInterface``; its mask is a
  boolean ``[rows, 1, 1, slots]`` the loop keeps, passed to the model as a prepared 4D mask). Grouped-query
  attention as two batched matmuls with the query heads of a KV head stacked as rows: each KV head is read
  once, never repeated to the query heads; softmax in fp32. One query per row only; anything else goes to SDPA.
- The decode step (``DecodeStep``) works in place on fixed buffers (input token, position, mask, write slot), so
  on CUDA it is captured once as a CUDA graph and replayed: one launch per step instead of ~1,300 small ones, and
  no per-step Python in the model. A new graph is captured whenever the row count changes.
- Finished rows. A row that produced an end-of-sequence token leaves the batch, with its cache rows, once at
  least ``DROP_SHARE`` of the rows have finished: compute follows the rows still going.

Models it does not fit (``unsupported`` says why; regeneration then uses ``generate``): caches other than plain
full attention (hybrid Gated-DeltaNet targets such as ``qwen3_5_text`` and ``qwen3_next``, sliding-window
layers), attention other than SDPA or not dispatched through ``AttentionInterface``, and generation configs
that change the greedy choice (``GREEDY_CHANGERS``).
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

log = logging.getLogger(__name__)

ATTENTION = "grouped_decode"  # no "flash" in it: transformers would look for a flash-attention kernel
DROP_SHARE = 0.125
# generation-config entries under which generate's greedy choice is not the plain argmax
GREEDY_CHANGERS = ("sequence_bias", "no_repeat_ngram_size", "bad_words_ids", "min_length", "min_new_tokens",
                   "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens",
                   "exponential_decay_length_penalty", "guidance_scale", "watermarking_config")


def decode_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """``query [rows, heads, 1, dim]`` against ``key``/``value [rows, kv_heads, filled, dim]``; returns
    ``[rows, 1, heads, dim]`` as SDPA does. Query head h belongs to KV head h // (heads // kv_heads)."""
    if query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    rows, heads, _, dim = query.shape
    kv_heads = key.shape[1]
    q = query.reshape(rows, kv_heads, heads // kv_heads, dim) * (dim ** -0.5 if scaling is None else scaling)
    scores = q @ key.transpose(-1, -2)  # [rows, kv_heads, group, filled]
    if attention_mask is not None:  # every row attends at least to its own token: no row of -inf only
        scores = scores.where(attention_mask, float("-inf"))
    probs = scores.softmax(-1, dtype=torch.float32).to(value.dtype)
    return (probs @ value).reshape(rows, 1, heads, dim), None


AttentionInterface.register(ATTENTION, decode_attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class SlotLayer(DynamicLayer):
    """A full-attention layer's keys and values in tensors of ``capacity`` slots, written in place. The prefill
    writes the first slots and attention reads those; once ``at`` (a one-element device tensor: the slot) is set,
    each update writes its token at slot ``at`` and attention reads all slots (the decode mask hides those not
    written yet): shapes that never change, so that a decode step can be replayed as a CUDA graph."""

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity, self.at = capacity, None

    def lazy_initialization(self, key_states, value_states):
        super().lazy_initialization(key_states, value_states)
        rows, heads = key_states.shape[:2]
        # zeros: a masked slot still meets its value in probs @ value (0 * NaN would be NaN)
        self.key_slots = key_states.new_zeros(rows, heads, self.capacity, key_states.shape[-1])
        self.value_slots = value_states.new_zeros(rows, heads, self.capacity, value_states.shape[-1])

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.at is None:  # the prefill
            filled = key_states.shape[-2]
            self.key_slots[:, :, :filled] = key_states
            self.value_slots[:, :, :filled] = value_states
            self.keys, self.values = self.key_slots[:, :, :filled], self.value_slots[:, :, :filled]
        else:
            self.key_slots.index_copy_(2, self.at, key_states)
            self.value_slots.index_copy_(2, self.at, value_states)
            self.keys, self.values = self.key_slots, self.value_slots
        return self.keys, self.values

    def batch_select_indices(self, indices):
        self.key_slots, self.value_slots = self.key_slots[indices], self.value_slots[indices]
        self.keys, self.values = self.key_slots, self.value_slots


class DecodeStep:
    """One greedy decode step of every row, in place on fixed buffers: ``token`` [rows] (the last new token: the
    step's input, then its output), ``position`` [rows] (that token's position), ``attend`` [rows, 1, 1, slots]
    (the slots each row attends) and the cache's write slot ``at``.

    ``graphs``: on CUDA, the first step at a row count runs eagerly on a side stream (the warm-up), the second is
    captured as a CUDA graph on that stream and every later one replays it (one launch instead of a thousand small
    ones); ``select`` changes the row count, so the next steps warm up and capture anew. All graphs of a step share
    one private memory pool, and the graph that ``select`` retires is kept until its successor is captured: the
    caching allocator refuses a capture into a pool whose graphs are all gone while memory of it is still
    allocated (its ``use_count > 0`` assertion). If a capture fails anyway, the process says so once and decodes
    eagerly from then on (the same answers, more launches)."""

    def __init__(self, model, cache: Cache, token, position, attend, at, graphs: bool):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.token, self.position, self.attend, self.at = token, position, attend, at
        self.graph, self.retired, self.warm = None, None, False
        self.stream = self.pool = None  # made by the first warm-up
        for layer in cache.layers:
            layer.at = at

    def _advance(self) -> None:
        self.attend.index_fill_(3, self.at, True)
        logits = self.model(input_ids=self.token[:, None], attention_mask=self.attend,
                            position_ids=self.position[:, None], past_key_values=self.cache, use_cache=True).logits
        self.token.copy_(logits[:, -1].argmax(-1))
        self.position += 1
        self.at += 1

    def __call__(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        elif not self.graphs:
            self._advance()
        elif not self.warm:
            self._warm_up()
            self.warm = True
        else:
            try:
                self.graph, self.retired = self._captured(), None
            except RuntimeError as error:
                graphs_failed(error)
                self.graphs, self.retired = False, None
                self._advance()  # a capture only records: nothing of the step ran
                return
            self.graph.replay()

    def _warm_up(self) -> None:
        if self.stream is None:
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._advance()
        torch.cuda.current_stream().wait_stream(self.stream)

    def _captured(self) -> torch.cuda.CUDAGraph:
        outer, graph = torch.cuda.current_stream(), torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self._advance()
        finally:
            torch.cuda.set_stream(outer)  # a capture that failed to begin leaves its stream current
        return graph

    def select(self, keep: torch.Tensor) -> None:
        """Keep the batch rows ``keep`` only (a new graph at the new row count)."""
        self.token, self.position, self.attend = self.token[keep], self.position[keep], self.attend[keep]
        self.cache.batch_select_indices(keep)
        self.retired = self.graph or self.retired
        self.graph, self.warm = None, False


capture_failure: str | None = None  # the first failed capture of this process: decode steps stay eager after it


def graphs_failed(error: Exception) -> None:
    global capture_failure
    if capture_failure is None:
        capture_failure = str(error).splitlines()[0]
        log.warning("CUDA graph capture of the decode step failed (%s); decoding eagerly from here on, with the "
                    "same answers", capture_failure)


def unsupported(model) -> str | None:
    """Why ``greedy_batch`` would not decode ``model`` as ``generate`` does; None when it would."""
    layers = DynamicCache(config=model.config).layers
    if not layers or any(type(layer) is not DynamicLayer for layer in layers):
        return f"cache layers {sorted({type(layer).__name__ for layer in layers})}, not only full attention"
    if model.config._attn_implementation != "sdpa" or not getattr(model, "_supports_attention_backend", False):
        return f"attention {model.config._attn_implementation!r}, not SDPA through AttentionInterface"
    if changed := [name for name in GREEDY_CHANGERS if getattr(model.generation_config, name, None)]:
        return f"the generation config sets {changed}"
    return None


def left_pad(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-id prompts as one left-padded batch: ids and attention mask (1: a prompt token), on the CPU."""
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = torch.tensor(prompt)
        mask[row, width - len(prompt):] = 1
    return ids, mask


def answer(row: list[int], eos: set[int]) -> tuple[list[int], bool]:
    """New tokens through the first end-of-sequence token, and whether there was none (the cap came first)."""
    end = next((i for i, token in enumerate(row) if token in eos), None)
    return (row, True) if end is None else (row[: end + 1], False)


def _record(results: list, prompts: torch.Tensor, rows: torch.Tensor, eos: set[int]) -> None:
    for prompt, row in zip(prompts.tolist(), rows.tolist()):
        results[prompt] = answer(row, eos)


@torch.no_grad()
def greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, *, eos: list[int], pad: int,
                 graphs: bool | None = None, drop_share: float = DROP_SHARE) -> list[tuple[list[int], bool]]:
    """Greedy continuations of token-id prompts (module docstring): per prompt the new tokens through the first
    of the ``eos`` tokens, and whether ``max_new_tokens`` came first. For models where ``unsupported`` is None.
    ``graphs``: decode steps as CUDA graphs (default: on CUDA). ``drop_share``: finished rows leave the batch once
    this share of it has finished (module docstring)."""
    device = next(model.parameters()).device
    graphs = (device.type == "cuda" if graphs is None else graphs) and capture_failure is None
    ids, prompt_mask = left_pad(prompts, pad)
    (count, width), eos_set = ids.shape, set(eos)
    positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)  # as generate makes them
    slots = width + max_new_tokens - 1
    attend = torch.zeros((count, 1, 1, slots), dtype=torch.bool)
    attend[:, 0, 0, :width] = prompt_mask.bool()
    ids, prompt_mask, positions, attend = (t.to(device) for t in (ids, prompt_mask, positions, attend))
    layers = DynamicCache(config=model.config).layers  # one per decoder layer, all full attention (unsupported)
    cache = Cache(layers=[SlotLayer(slots) for _ in layers])
    keep_last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    eos_ids = torch.tensor(sorted(eos), dtype=torch.long, device=device)
    tokens = torch.empty((count, max_new_tokens), dtype=torch.long, device=device)
    index = torch.arange(count, device=device)  # batch row -> prompt
    done = torch.zeros(count, dtype=torch.bool, device=device)
    results: list = [None] * count
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    try:
        logits = model(input_ids=ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
                       use_cache=True, **keep_last).logits
        at = torch.full((1,), width, dtype=torch.long, device=device)
        step_all = DecodeStep(model, cache, logits[:, -1].argmax(-1), prompt_mask.sum(-1), attend, at, graphs)
        for step in range(max_new_tokens):
            if step:
                step_all()
            tokens[:, step] = step_all.token
            done |= torch.isin(step_all.token, eos_ids)
            finished = int(done.sum())
            if finished == len(index) or step + 1 == max_new_tokens:
                break
            if finished >= drop_share * len(index):
                _record(results, index[done], tokens[done, : step + 1], eos_set)
                keep = (~done).nonzero().squeeze(1)
                tokens, index, done = (t[keep] for t in (tokens, index, done))
                step_all.select(keep)
    finally:
        model.set_attn_implementation(previous)
    _record(results, index, tokens[:, : step + 1], eos_set)
    return results
