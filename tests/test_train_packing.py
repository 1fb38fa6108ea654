"""Packed samples do not attend to each other: a packed row's per-token losses equal each sample run alone.

No Ray, no DeepSpeed: just the collate function (4D block-diagonal causal mask, first label of each sample
masked) and a tiny randomly initialised Llama and Qwen2 in fp32.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipelines.config import ModelConfig, ModelInit
from pipelines.train.collate import IGNORE_INDEX, block_causal_mask, collate_rows, segment_ids
from pipelines.train.loss import token_losses
from pipelines.train.model import build_model, load_tokenizer


def _samples(lengths: list[int], vocab: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, vocab, size=n) for n in lengths]


def _pack(samples: list[np.ndarray]) -> dict[str, list[np.ndarray]]:
    """One packed row: ids concatenated, labels = ids (every token supervised), positions restart at 0."""
    ids = np.concatenate(samples)
    return {
        "input_ids": [ids],
        "labels": [ids.copy()],
        "position_ids": [np.concatenate([np.arange(len(s)) for s in samples])],
    }


def test_segment_ids_and_mask_shape():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert segment_ids(pos).tolist() == [[0, 0, 0, 1, 1, 2]]
    mask = block_causal_mask(pos)
    assert mask.shape == (1, 1, 6, 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed[4] == [0, 0, 0, 1, 1, 0]  # b1 sees b0 and itself only
    assert allowed[5] == [0, 0, 0, 0, 0, 1]


def test_collate_pads_and_masks_first_labels():
    rows = {
        "input_ids": np.array([np.array([5, 6, 7, 8, 9]), np.array([5, 6])], dtype=object),
        "labels": np.array([np.array([5, 6, 7, 8, 9]), np.array([-100, 6])], dtype=object),
        "position_ids": np.array([np.array([0, 1, 2, 0, 1]), np.array([0, 1])], dtype=object),
    }
    out = collate_rows(rows, "mask", pad_token_id=0, pad_to_multiple_of=4)
    assert out["input_ids"].shape == (2, 8)
    assert out["labels"][0].tolist() == [-100, 6, 7, -100, 9, -100, -100, -100]
    assert out["labels"][1].tolist() == [-100, 6] + [IGNORE_INDEX] * 6
    assert out["position_ids"][1].tolist() == [0, 1, 0, 1, 2, 3, 4, 5]  # padding starts its own segment
    assert out["attention_mask"].shape == (2, 1, 8, 8)
    assert int(out["num_tokens"]) == 7 and int(out["num_rows"]) == 2
    flat = collate_rows(rows, "flatten")
    assert flat["input_ids"].shape == (1, 7) and "attention_mask" not in flat


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_losses_equal_unpacked(architecture, attn):
    model_cfg = ModelConfig(
        tokenizer="demo://tokenizer",
        init=ModelInit(architecture=architecture, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    )
    tok = load_tokenizer(model_cfg)
    model = build_model(model_cfg, tok, attn).eval()
    samples = _samples([7, 12, 5], vocab=len(tok))
    with torch.no_grad():
        packed = collate_rows(_pack(samples), "mask", tok.pad_token_id, pad_to_multiple_of=8)
        logits = model(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                       attention_mask=packed["attention_mask"]).logits
        packed_losses = token_losses(logits, packed["labels"])[0]
        alone = []
        for s in samples:
            t = torch.from_numpy(s)[None]
            alone.append(token_losses(model(input_ids=t).logits, t)[0])
        # Without the mask the later samples see the earlier ones, so the losses must differ (guards
        # against a test that passes because masking does nothing).
        leaky = token_losses(model(input_ids=packed["input_ids"]).logits, packed["labels"])[0]

    # Packed targets: positions 1..L-1; sample k's tokens 1.. map to alone[k]; first tokens carry no loss.
    start = 0
    for s, ref in zip(samples, alone, strict=True):
        got = packed_losses[start:start + len(s) - 1]
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        if start + len(s) - 1 < len(packed_losses):
            assert packed_losses[start + len(s) - 1] == 0  # boundary: no cross-sample target
        start += len(s)
    assert (packed_losses[sum(len(s) for s in samples) - 1:] == 0).all()  # padding
    assert not torch.allclose(leaky[len(samples[0]):sum(map(len, samples)) - 1],
                              packed_losses[len(samples[0]):sum(map(len, samples)) - 1], atol=1e-3)
