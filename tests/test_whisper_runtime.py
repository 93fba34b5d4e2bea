"""The engine's Whisper decoder against Hugging Face ``WhisperForConditionalGeneration`` on a tiny random config:
same logits within 1e-4 (float32) for the prompt and for every node of token trees, in one ragged batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specstream.errors import UnsupportedArchitectureError
from specstream.kernels.tree_attention import build_tree_mask
from specstream.stages.speculative.models.llama import ForwardBatch
from specstream.stages.speculative.models.loader import load_decoder
from specstream.stages.speculative.models.tiny_whisper import TinyWhisperSpec, build_tiny_whisper
from specstream.stages.speculative.models.whisper import WhisperDecoder, load_whisper_encoder
from specstream.stages.speculative.tree import TokenTree
from whisper_fixtures import one_torch_thread  # noqa: F401  (autouse)

SPEC = TinyWhisperSpec(max_source_positions=32, max_target_positions=64)
ATOL = 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from transformers import WhisperForConditionalGeneration

    path = build_tiny_whisper(tmp_path_factory.mktemp("tiny-whisper"), SPEC, seed=3)
    hf = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_decoder(path)
    encoder = load_whisper_encoder(path)
    return hf, ours, encoder


def _features(seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_normal((1, SPEC.num_mel_bins, 2 * SPEC.max_source_positions))
                            .astype(np.float32))


def _hf_logits(hf, enc: torch.Tensor, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        out = hf(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids]), use_cache=False)
    return out.logits[0]  # [T, V]


def _tree(root: int, seed: int) -> TokenTree:
    """A branching tree: root -> a -> (b -> c, d), root -> e -> f."""
    rng = np.random.default_rng(seed)
    a, b, c, d, e, f = (int(x) for x in rng.integers(0, 50000, 6))
    tree = TokenTree(root)
    na = tree.add(0, a)
    nb = tree.add(na, b)
    tree.add(nb, c)
    tree.add(na, d)
    ne = tree.add(0, e)
    tree.add(ne, f)
    return tree


def test_loader_builds_the_whisper_runtime(models):
    _, ours, _ = models
    assert isinstance(ours, WhisperDecoder)
    assert ours.config.vocab_size == SPEC.vocab_size
    assert ours.config.max_position_embeddings == SPEC.max_target_positions
    # the output projection is the token embeddings (tied; on the CPU a oneDNN pre-packed copy of them)
    x = torch.randn(3, ours.config.d_model, generator=torch.Generator().manual_seed(0))
    w = ours.model.decoder.embed_tokens.weight
    with torch.no_grad():
        assert torch.allclose(ours.proj_out(x), x @ w.T, atol=1e-5, rtol=1e-5)


def test_encoder_is_the_hf_module(models):
    hf, _, encoder = models
    feats = _features(0)
    with torch.no_grad():
        assert torch.equal(encoder(feats).last_hidden_state, hf.model.encoder(feats).last_hidden_state)


def test_prefill_and_tree_logits_match_hf(models):
    hf, ours, encoder = models
    prompts = {0: [50257, 50362, 383, 2068, 7586], 2: [50257, 50362, 11]}  # slot -> prompt
    encs = {}
    for slot, seed in ((0, 1), (2, 2)):
        with torch.no_grad():
            encs[slot] = encoder(_features(seed)).last_hidden_state
    cache = ours.new_cache(3, 32)
    for slot, enc in encs.items():
        ours.set_encoder_output(cache, slot, enc[0])

    # prefill both prompts in one ragged forward
    slots = sorted(prompts)
    t = max(len(p) for p in prompts.values())
    ids = torch.zeros((2, t), dtype=torch.long)
    pos = torch.zeros((2, t), dtype=torch.long)
    cols = torch.full((2, t), cache.scratch, dtype=torch.long)
    for i, s in enumerate(slots):
        n = len(prompts[s])
        ids[i, :n], pos[i, :n], cols[i, :n] = torch.tensor(prompts[s]), torch.arange(n), torch.arange(n)
    mask = build_tree_mask(torch.zeros(2), [torch.ones(len(prompts[s]), len(prompts[s]), dtype=torch.bool).tril()
                                            for s in slots], t, t)
    logits, _ = ours.forward_batch(cache, ForwardBatch(torch.tensor(slots), ids, pos, cols, mask))
    for i, s in enumerate(slots):
        n = len(prompts[s])
        ref = _hf_logits(hf, encs[s], prompts[s])
        assert torch.allclose(logits[i, :n], ref, atol=ATOL, rtol=0), float((logits[i, :n] - ref).abs().max())
        cache.lengths[s] = n

    # one token tree per slot after its prompt, verified in one forward
    trees = {s: _tree(root, seed) for s, root, seed in ((0, 1169, 5), (2, 464, 6))}
    compiled = {s: tr.compile() for s, tr in trees.items()}
    t = max(c.num_nodes for c in compiled.values())
    key_len = max(cache.lengths[s] + compiled[s].num_nodes for s in slots)
    ids = torch.zeros((2, t), dtype=torch.long)
    pos = torch.zeros((2, t), dtype=torch.long)
    cols = torch.full((2, t), cache.scratch, dtype=torch.long)
    for i, s in enumerate(slots):
        c, base = compiled[s], cache.lengths[s]
        ids[i, :c.num_nodes] = c.tokens
        pos[i, :c.num_nodes] = base + c.depths
        cols[i, :c.num_nodes] = base + torch.arange(c.num_nodes)
    mask = build_tree_mask(torch.tensor([cache.lengths[s] for s in slots]),
                           [compiled[s].ancestor_mask for s in slots], key_len, t)
    logits, _ = ours.forward_batch(cache, ForwardBatch(torch.tensor(slots), ids, pos, cols, mask))
    for i, s in enumerate(slots):
        tree = trees[s]
        for node in range(len(tree)):
            path = [tree.tokens[j] for j in tree.path_to(node)]
            ref = _hf_logits(hf, encs[s], prompts[s] + path)[-1]
            diff = float((logits[i, node] - ref).abs().max())
            assert diff <= ATOL, f"slot {s} node {node}: max |diff| {diff}"


def test_shorter_encoder_output_is_masked(models):
    """An encoder output shorter than the cache (e.g. a model with fewer source positions) is attended alone."""
    hf, ours, encoder = models
    with torch.no_grad():
        enc = encoder(_features(4)).last_hidden_state
    short = enc[:, :20]
    cache = ours.new_cache(2, 16)
    ours.set_encoder_output(cache, 0, short[0])
    ours.set_encoder_output(cache, 1, enc[0])
    ids = torch.tensor([[50257, 50362, 1000]] * 2)
    pos = torch.arange(3).repeat(2, 1)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().repeat(2, 1, 1)
    logits, _ = ours.forward_batch(cache, ForwardBatch(torch.tensor([0, 1]), ids, pos, pos.clone(), mask))
    assert torch.allclose(logits[0], _hf_logits(hf, short, ids[0].tolist()), atol=ATOL, rtol=0)
    assert torch.allclose(logits[1], _hf_logits(hf, enc, ids[1].tolist()), atol=ATOL, rtol=0)


def test_projected_cross_kv_equals_projecting_per_slot(models):
    """``project`` (a batch of encoder outputs, once) then ``set_encoder_output(CrossKV)`` gives the same keys,
    values and logits as projecting in ``set_encoder_output``; shorter outputs keep their length."""
    hf, ours, encoder = models
    with torch.no_grad():
        enc = encoder(_features(4)).last_hidden_state
    batch2 = torch.cat([enc, enc.flip(1)])
    kvs = ours.project(batch2)
    assert len(kvs) == 2 and kvs[0].k.shape[:3] == (len(ours.model.decoder.layers), ours.config.decoder_attention_heads,
                                                    enc.shape[1])
    a, b = ours.new_cache(2, 16), ours.new_cache(2, 16)
    for slot in (0, 1):
        ours.set_encoder_output(a, slot, batch2[slot])
        ours.set_encoder_output(b, slot, kvs[slot])
    # batched and per-slot projections may round differently (different GEMM shapes)
    assert torch.allclose(a.cross_k, b.cross_k, atol=1e-5, rtol=0) and torch.allclose(a.cross_v, b.cross_v, atol=1e-5,
                                                                                      rtol=0)
    assert a.enc_lengths == b.enc_lengths
    ids = torch.tensor([[50257, 50362, 1000]] * 2)
    pos = torch.arange(3).repeat(2, 1)
    mask = torch.ones(3, 3, dtype=torch.bool).tril().repeat(2, 1, 1)
    logits, _ = ours.forward_batch(b, ForwardBatch(torch.tensor([0, 1]), ids, pos, pos.clone(), mask))
    assert torch.allclose(logits[0], _hf_logits(hf, enc, ids[0].tolist()), atol=ATOL, rtol=0)
    short = ours.project(enc[:, :20])[0]
    ours.set_encoder_output(b, 0, short)
    assert b.enc_lengths[0] == 20


def test_forward_without_encoder_output_raises(models):
    _, ours, _ = models
    cache = ours.new_cache(1, 8)
    batch = ForwardBatch(torch.tensor([0]), torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([[0]]),
                         torch.ones(1, 1, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="encoder output"):
        ours.forward_batch(cache, batch)


def test_non_whisper_config_rejected(tmp_path):
    from specstream.stages.speculative.models.whisper import whisper_config_from_dict

    with pytest.raises(UnsupportedArchitectureError):
        whisper_config_from_dict({"model_type": "llama"})
    with pytest.raises(UnsupportedArchitectureError, match="activation"):
        whisper_config_from_dict({**SPEC.config_dict(), "activation_function": "swish"})


def test_cross_attention_scores_match_hf(models, tmp_path):
    """Word alignment reads the decoder's cross-attention: the teacher-forced pass returns the same logits as the
    engine's forward and, after a softmax, Hugging Face's eager cross-attention weights of the chosen heads."""
    from transformers import WhisperForConditionalGeneration

    hf, ours, encoder = models
    eager = WhisperForConditionalGeneration.from_pretrained(hf.name_or_path, dtype=torch.float32,
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        enc = encoder(_features(7)).last_hidden_state
    ids = [50257, 50362, 383, 2068, 7586, 50256]
    heads = [(0, 1), (1, 3), (1, 0)]
    logits, scores = ours.cross_attention_scores(ours.project(enc)[0], ids, heads)
    with torch.no_grad():
        ref = eager(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids]), output_attentions=True)
    assert scores.shape == (3, len(ids), SPEC.max_source_positions)
    assert torch.allclose(logits, ref.logits[0], atol=ATOL, rtol=0)
    for k, (layer, head) in enumerate(heads):
        assert torch.allclose(scores[k].softmax(-1), ref.cross_attentions[layer][0, head], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="alignment heads"):
        ours.cross_attention_scores(ours.project(enc)[0], ids, [(9, 0)])
