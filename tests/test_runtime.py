"""The decoder runtime against Hugging Face's reference implementation on tiny random configs."""

from __future__ import annotations

import pytest
import torch

from specstream.errors import CheckpointNotFoundError, UnsupportedArchitectureError
from specstream.kernels.tree_attention import build_tree_mask
from specstream.stages.speculative.models.kv_cache import KVCache
from specstream.stages.speculative.models.llama import ForwardBatch
from specstream.stages.speculative.models.checkpoint import resolve_checkpoint
from specstream.stages.speculative.models.loader import load_decoder
from specstream.stages.speculative.models.tiny import TinyDecoderSpec, build_tiny_decoder
from specstream.stages.speculative.tree import TokenTree


def _forward(model, cache: KVCache, slot: int, tokens, positions, columns, anc, prefix):
    t = len(tokens)
    mask = build_tree_mask(torch.tensor([prefix]), [anc], prefix + t, t)
    batch = ForwardBatch(torch.tensor([slot]), torch.tensor([tokens]), torch.tensor([positions]),
                         torch.tensor([columns]), mask)
    return model.forward_batch(cache, batch)[0][0]


def _prefill(model, cache, slot, prompt):
    n = len(prompt)
    logits = _forward(model, cache, slot, prompt, list(range(n)), list(range(n)),
                      torch.ones(n, n, dtype=torch.bool).tril(), 0)
    cache.lengths[slot] = n
    return logits


def _tree():
    tree = TokenTree(17)
    a = tree.add(0, 5)
    tree.add(a, 9)
    b = tree.add(0, 200)
    c = tree.add(b, 31)
    tree.add(c, 4)
    tree.add(b, 77)
    return tree


MODELS = {
    "llama": TinyDecoderSpec(vocab_size=256),
    "qwen2": TinyDecoderSpec(model_type="qwen2", vocab_size=256, tie_word_embeddings=True),
    "mistral": TinyDecoderSpec(model_type="mistral", vocab_size=256, num_key_value_heads=1),
    "llama3-rope": TinyDecoderSpec(vocab_size=256, extra={"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "linear-rope": TinyDecoderSpec(vocab_size=256, extra={"rope_scaling": {"type": "linear", "factor": 2.0}}),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_logits_equal_hf_for_prefill_and_every_tree_node(tmp_path, name):
    from transformers import AutoModelForCausalLM

    path = build_tiny_decoder(tmp_path / name, MODELS[name], seed=4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = load_decoder(path)
    cache = model.new_cache(num_slots=3, max_len=64)
    prompt = [3, 141, 59, 26, 5, 35, 89, 79, 32]
    ours = _prefill(model, cache, 1, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours - ref).abs().max().item() < 1e-4
    # a tree rooted at the next token: each node's logits = HF's logits for prefix + its path
    tree = _tree()
    ct = tree.compile()
    base = cache.lengths[1]
    logits = _forward(model, cache, 1, ct.tokens.tolist(), (base + ct.depths).tolist(),
                      list(range(base, base + ct.num_nodes)), ct.ancestor_mask, base)
    for node in range(ct.num_nodes):
        seq = prompt + [tree.tokens[i] for i in tree.path_to(node)]
        with torch.no_grad():
            want = hf(torch.tensor([seq])).logits[0, -1]
        assert (logits[node] - want).abs().max().item() < 1e-4, f"node {node}"


def test_ragged_batch_rows_match_single_rows(tiny):
    model = load_decoder(tiny.target)
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5, 4, 3], [42]]
    single = []
    for p in prompts:
        cache = model.new_cache(1, 32)
        single.append(_prefill(model, cache, 0, p)[-1])
    cache = model.new_cache(4, 32)
    t = max(len(p) for p in prompts)
    ancs = [torch.ones(len(p), len(p), dtype=torch.bool).tril() for p in prompts]
    mask = build_tree_mask(torch.zeros(3, dtype=torch.long), ancs, t, t)
    ids = torch.zeros(3, t, dtype=torch.long)
    cols = torch.full((3, t), cache.scratch)
    for i, p in enumerate(prompts):
        ids[i, : len(p)] = torch.tensor(p)
        cols[i, : len(p)] = torch.arange(len(p))
    batch = ForwardBatch(torch.tensor([3, 0, 2]), ids, torch.arange(t).repeat(3, 1), cols, mask,
                         logit_index=torch.tensor([[len(p) - 1] for p in prompts]))
    logits = model.forward_batch(cache, batch)[0][:, 0]
    for i in range(3):
        assert (logits[i] - single[i]).abs().max().item() < 1e-5


def test_sharded_checkpoint_loads_same_weights(tiny):
    a = load_decoder(tiny.target)
    b = load_decoder(tiny.sharded)
    assert len(list(tiny.sharded.glob("model-*.safetensors"))) == 3
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)


def test_bfloat16_runs_and_mostly_agrees(tiny):
    f32 = load_decoder(tiny.target, "float32")
    bf16 = load_decoder(tiny.target, "bfloat16")
    assert bf16.dtype == torch.bfloat16
    prompt = list(range(10, 40))
    a = _prefill(f32, f32.new_cache(1, 64), 0, prompt).argmax(-1)
    b = _prefill(bf16, bf16.new_cache(1, 64), 0, prompt).argmax(-1)
    assert (a == b).float().mean().item() >= 0.8


def test_offline_hub_id_names_missing_files(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(CheckpointNotFoundError) as err:
        resolve_checkpoint("no-such-owner/no-such-model")
    msg = str(err.value)
    assert "config.json" in msg and "safetensors" in msg
    assert "hf download no-such-owner/no-such-model --local-dir DIR" in msg


def test_unsupported_architecture_is_a_clear_error(tmp_path):
    path = build_tiny_decoder(tmp_path / "m", TinyDecoderSpec(), seed=0)
    cfg = (path / "config.json").read_text().replace('"model_type": "llama"', '"model_type": "gpt2"')
    (path / "config.json").write_text(cfg)
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        load_decoder(path)


def test_directory_without_config_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="config.json"):
        resolve_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_packed_forward_runs_the_linears_on_real_tokens_only_with_the_same_logits(tiny, dtype):
    """A ragged batch (rows of 1, 5 and 2 tokens padded to 5): with ``row_lengths`` the projections, MLPs and
    output head see the 8 real tokens, not 15, and every real row's logits equal the padded forward's (to float32
    rounding at float32; bitwise at int4, whose kernels are row-invariant)."""
    model = load_decoder(tiny.target, dtype)  # int4: the VNNI kernel, or PyTorch's where it is missing
    model._fused_args = False  # the PyTorch layers, whose modules the hooks see (the C++ layer's packed rows:
    # tests/test_decoder_layer.py)
    lengths, t = [1, 5, 2], 5
    prompt = [11, 12, 13, 14]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(3, 250, (3, t), generator=g)
    prefix = len(prompt)
    pos = prefix + torch.arange(t)[None].expand(3, t)
    valid = torch.arange(t)[None] < torch.tensor(lengths)[:, None]

    def run(row_lengths):
        cache = model.new_cache(3, 32)
        for slot in range(3):
            _prefill(model, cache, slot, prompt)
        cols = torch.where(valid, pos, torch.full_like(pos, cache.scratch))
        anc = torch.ones(t, t, dtype=torch.bool).tril()
        mask = build_tree_mask(torch.full((3,), prefix), [anc] * 3, prefix + t, t)
        rows = []
        hook = model.model.layers[0].mlp.register_forward_hook(lambda m, a, out: rows.append(a[0].shape))
        head = model.lm_head.register_forward_hook(lambda m, a, out: rows.append(a[0].shape))
        try:
            batch = ForwardBatch(torch.arange(3), ids, pos, cols, mask, row_lengths=row_lengths)
            logits = model.forward_batch(cache, batch)[0]
        finally:
            hook.remove()
            head.remove()
        return logits, rows

    padded, rows_padded = run(None)
    packed, rows_packed = run(lengths)
    assert rows_packed == [torch.Size([8, model.config.hidden_size])] * 2  # the layer-0 MLP, then the head
    assert rows_padded[0][:2] == torch.Size([3, 5])  # padded: 15 token rows
    for b, n in enumerate(lengths):
        if dtype == "int4":
            assert torch.equal(packed[b, :n], padded[b, :n])
        else:
            torch.testing.assert_close(packed[b, :n], padded[b, :n], rtol=1e-5, atol=1e-5)
