"""The mask-token rule (dflash_pipeline.mask_token): never a stop token, a chat-template control token or bos/pad/unk;
on a small real tokenizer built here and on SmolLM2's own (GGUF) tokenizer, config and generation config."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, GenerationConfig, PreTrainedTokenizerFast

from dflash_pipeline.drafter.mask_token import forbidden_mask_ids, resolve_mask_token_id


def small_tokenizer(mask: str | None = None, template: str | None = None) -> PreTrainedTokenizerFast:
    """Words a..d, then added tokens <bos> 5, <eos> 6, <|im_start|> 7, <|im_end|> 8, <spare1> 9, <spare2> 10, and a
    chat template that writes <|im_start|> and <|im_end|>: 11 tokens."""
    model = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<unk>", "a", "b", "c", "d"])}, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<spare1>", "<spare2>"]})
    if mask:
        tokenizer.add_special_tokens({"mask_token": mask})
    tokenizer.chat_template = template or "{% for m in messages %}<|im_start|>{{ m.role }} {{ m.content }}<|im_end|>{% endfor %}"
    return tokenizer


def test_the_rule_excludes_stop_template_and_bos_pad_unk_tokens():
    tokenizer = small_tokenizer()
    assert forbidden_mask_ids(tokenizer) == {0: "the unk token", 5: "the bos token", 6: "a stop token (eos)",
                                             7: "a control token of the chat template",
                                             8: "a control token of the chat template"}
    # the target's own stop tokens count too: its config's and its generation config's eos ids
    stops = forbidden_mask_ids(tokenizer, [GenerationConfig(eos_token_id=[9, 6])])
    assert stops[9] == "a stop token (eos)"


def test_resolution_order():
    tokenizer = small_tokenizer()
    assert resolve_mask_token_id(tokenizer, 11, explicit=3) == 3  # an ordinary token may be chosen explicitly
    assert resolve_mask_token_id(tokenizer, 16) == 11  # len(tokenizer): an unused padding row of the embedding
    assert resolve_mask_token_id(tokenizer, 11) == 10  # no padding row: the highest-id allowed added token
    assert resolve_mask_token_id(tokenizer, 11, target_configs=[GenerationConfig(eos_token_id=10)]) == 9
    assert resolve_mask_token_id(small_tokenizer(mask="<mask>"), 16) == 11  # the tokenizer's own mask token
    assert len(small_tokenizer(mask="<mask>")) == 12


@pytest.mark.parametrize("token_id, reason", [(6, "a stop token"), (7, "a control token of the chat template"),
                                              (5, "the bos token")])
def test_an_explicit_id_against_the_rule_is_refused_with_the_rule(token_id, reason):
    with pytest.raises(ValueError, match=reason) as error:
        resolve_mask_token_id(small_tokenizer(), 11, explicit=token_id)
    assert "must not be a stop token" in str(error.value) and "config/README.md" in str(error.value)
    with pytest.raises(ValueError, match="outside the embedding"):
        resolve_mask_token_id(small_tokenizer(), 11, explicit=11)


def test_no_allowed_id_is_an_error():
    template = "<|im_start|><|im_end|><spare1><spare2>"  # every added token is a control token
    with pytest.raises(ValueError, match="set train.mask_token_id"):
        resolve_mask_token_id(small_tokenizer(template=template), 11)


def test_smollm2_gets_an_unused_row_and_not_its_eos(smollm2_dir, smollm2_tokenizer):
    """SmolLM2-135M-Instruct's GGUF tokenizer reports <|im_start|> (id 1) as bos and eos, its config and generation
    config <|im_end|> (2); its 49,152-row embedding has no padding row. The rule picks <empty_output> (16): one of
    the code-pretraining special tokens (3..16) the chat template never writes, whose rows the instruct model never
    produces (config/README.md, 'The mask token')."""
    configs = [AutoConfig.from_pretrained(smollm2_dir), GenerationConfig.from_pretrained(smollm2_dir)]
    assert smollm2_tokenizer.eos_token_id == 1 and json.loads((smollm2_dir / "config.json").read_text())["eos_token_id"] == 2
    forbidden = forbidden_mask_ids(smollm2_tokenizer, configs)
    assert set(forbidden) == {0, 1, 2}
    assert resolve_mask_token_id(smollm2_tokenizer, 49152, target_configs=configs) == 16
    assert smollm2_tokenizer.convert_ids_to_tokens(16) == "<empty_output>"
    with pytest.raises(ValueError, match="stop token"):
        resolve_mask_token_id(smollm2_tokenizer, 49152, explicit=1, target_configs=configs)
