"""The mask token: the id whose embedding row fills the B-1 drafted slots of every block (docs/design.md, "DFlash, precisely").

The rule: the mask token is never a token that ends generation (the tokenizer's eos, the eos ids of the target's
config and generation config), never a token the chat template writes (``<|im_start|>``, ``<think>``, ...), and never
the bos, pad or unk token. Serving engines and the reference (``dflash_generate``) fill a block's unfilled slots with
it; a loop that checks stop tokens on its output buffer, or an engine that treats template tokens specially, then
acts on a token the target never produced. Per model family (config/README.md, "The mask token"): Qwen3 151669 (=
``len(tokenizer)``, a padding row), Qwen3.5/3.6 248070 (``<|audio_start|>``, as the published drafters), SmolLM2 16
(``<empty_output>``, an untrained row).

Resolution when no id is configured: the tokenizer's mask token, else ``len(tokenizer)`` when the embedding has
that (padding) row, else the highest-id added token the rule allows. A configured id that breaks the rule is an
error that says why.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

RULE = ("the mask token must not be a stop token (eos of the tokenizer, the target's config or generation config), a "
        "token the chat template writes, or the bos/pad/unk token")


def _ids(value) -> set[int]:
    if value is None:
        return set()
    return {int(v) for v in value} if isinstance(value, (list, tuple, set)) else {int(value)}


def stop_token_ids(tokenizer, target_configs=()) -> set[int]:
    """The eos ids of the tokenizer and of each of ``target_configs`` (model configs, their text configs, generation
    configs: anything with an ``eos_token_id``)."""
    stops = _ids(getattr(tokenizer, "eos_token_id", None))
    for config in target_configs:
        for part in (config, config.get_text_config() if hasattr(config, "get_text_config") else None):
            stops |= _ids(getattr(part, "eos_token_id", None))
    return stops


def target_stop_configs(target: str, target_config) -> list:
    """The configs that name the target's stop tokens: its model config and, where the checkpoint has one, its
    generation config."""
    from transformers import GenerationConfig

    try:
        return [target_config, GenerationConfig.from_pretrained(target)]
    except OSError:  # no generation_config.json
        return [target_config]


def template_token_ids(tokenizer) -> set[int]:
    """Added tokens whose text the chat template contains: the control tokens it writes."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):  # named templates
        template = "\n".join(template.values())
    return {token_id for text, token_id in tokenizer.get_added_vocab().items() if text in template}


def forbidden_mask_ids(tokenizer, target_configs=()) -> dict[int, str]:
    """Token id -> why the rule excludes it as the mask token."""
    reasons = {i: "a control token of the chat template" for i in template_token_ids(tokenizer)}
    for name in ("bos", "pad", "unk"):
        for i in _ids(getattr(tokenizer, f"{name}_token_id", None)):
            reasons[i] = f"the {name} token"
    for i in stop_token_ids(tokenizer, target_configs):
        reasons[i] = "a stop token (eos)"
    return reasons


def resolve_mask_token_id(tokenizer, embedding_rows: int, explicit: int | None = None, target_configs=()) -> int:
    """The configured id (checked against the rule), else the tokenizer's mask token, else ``len(tokenizer)`` when
    that embedding row exists, else the highest-id added token the rule allows."""
    forbidden = forbidden_mask_ids(tokenizer, target_configs)
    if explicit is not None:
        explicit = int(explicit)
        if not 0 <= explicit < embedding_rows:
            raise ValueError(f"mask token id {explicit} outside the embedding's {embedding_rows} rows")
        if explicit in forbidden:
            raise ValueError(f"mask token id {explicit} ({tokenizer.convert_ids_to_tokens(explicit)!r}) is "
                             f"{forbidden[explicit]}: {RULE}; choose another (config/README.md, 'The mask token')")
        return explicit
    candidates = [getattr(tokenizer, "mask_token_id", None)]
    if len(tokenizer) < embedding_rows:
        candidates.append(len(tokenizer))
    candidates += sorted(tokenizer.get_added_vocab().values(), reverse=True)
    for token_id in candidates:
        if token_id is not None and 0 <= int(token_id) < embedding_rows and int(token_id) not in forbidden:
            return int(token_id)
    raise ValueError(f"no mask token id by the rule ({RULE}) among the tokenizer's mask token, the padding row "
                     f"{len(tokenizer)} and its added tokens: set train.mask_token_id")
