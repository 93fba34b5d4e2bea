"""Host work per step does not grow with the context (issue 20 item 7).

Not a wall-clock test: the same decode step (one request, the same token tree, a logits processor on it) is
measured at context 64 and at context 2048 by what the host allocates (``tracemalloc``'s peak of Python
allocations during the step) and by the size of the histories the processors receive. Before the fix each tree
node's history was a fresh ``context + path`` list (16 KiB of pointers per node at 2048) and
``Request.context`` was rebuilt on every read (scheduler, drafter inputs, commit limit).

An engine with the n-gram drafter on is measured the same way and also by the Python lines the step executes
(``sys.settrace`` line events, a deterministic count of host work): its output is forced into a loop of four
tokens the prompt never holds, so both contexts draft the same trees. Before the n-gram index the drafter
scanned the whole context every step: 2,858 lines a step at 64, 20,714 at 2048 (2,149 at both now).
"""

from __future__ import annotations

import sys
import tracemalloc

import pytest
import torch

from specstream.stages.speculative.drafters.model import TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine
from specstream.stages.speculative.logits import LogitsProcessor
from specstream.stages.speculative.models.tiny import TinyDecoderSpec, build_tiny_decoder, random_decoder_state, \
    save_checkpoint

SHORT, LONG = 64, 2048


class Probe(LogitsProcessor):
    """Leaves the scores as they are; records, per call, how many rows and how many bytes of histories."""

    def __init__(self):
        self.calls: list[tuple[int, int, int]] = []  # (rows, bytes of the history objects, len of row 0)

    def __call__(self, sequences, scores):
        self.calls.append((len(sequences), sum(sys.getsizeof(s) for s in sequences), len(sequences[0])))
        return scores


@pytest.fixture(scope="module")
def long_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("long")
    spec = TinyDecoderSpec(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    state = random_decoder_state(spec, seed=4)
    target = save_checkpoint(root / "target", spec.config_dict(), state)
    draft = build_tiny_decoder(root / "draft", spec, seed=8, noise_from=state, noise=0.3)
    cfg = EngineConfig(num_slots=1, max_len=LONG + 64, tree=TreeSpec.parse("1,1,3,1"), adaptive=False,
                       cost_aware=False)
    return SpeculativeEngine.from_checkpoints(target, [draft], ngram=False, config=cfg)


@pytest.fixture(scope="module")
def ngram_engine(tmp_path_factory):
    """The same target with the n-gram drafter only (its tree: one chain, up to depth 4)."""
    root = tmp_path_factory.mktemp("ngram")
    spec = TinyDecoderSpec(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=4096)
    target = save_checkpoint(root / "target", spec.config_dict(), random_decoder_state(spec, seed=4))
    cfg = EngineConfig(num_slots=1, max_len=LONG + 64, tree=TreeSpec.parse("1,1,3,1"), adaptive=False,
                       cost_aware=False)
    return SpeculativeEngine.from_checkpoints(target, [], ngram=True, config=cfg)


class Loop(Probe):
    """A :class:`Probe` that also forces the next token to ``250 + len(history) % 4`` (prompts hold < 250)."""

    def __call__(self, sequences, scores):
        super().__call__(sequences, scores)
        scores.fill_(float("-inf"))
        for i, s in enumerate(sequences):
            scores[i, 250 + len(s) % 4] = 0.0
        return scores


def _lines(step) -> int:
    """Python line events while ``step()`` runs (every frame, every module). The cyclic garbage collector is run
    before and held off during the step: a collection inside it would run the finalizers of whatever earlier tests
    in the process left behind (a CI worker once counted 9 more lines in one step so), which is not the step's
    work."""
    import gc

    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def glob(frame, event, arg):
        return local

    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    sys.settrace(glob)
    try:
        step()
    finally:
        sys.settrace(None)
        if enabled:
            gc.enable()
    return count


def _decode_step_host_work(eng, n_ctx: int, probe: Probe | None = None,
                           lines: list[int] | None = None, warmup: int = 1) -> tuple[int, tuple[int, int, int], list[int]]:
    """(peak host bytes of a decode step (least of 3, after ``warmup`` decode steps), the probe's record of it,
    the output so far); with ``lines``, two more steps' Python line counts are appended to it."""
    prompt = torch.randint(0, 250, (n_ctx,), generator=torch.Generator().manual_seed(n_ctx)).tolist()
    probe = probe or Probe()
    req = eng.add_request(eng.make_request(prompt, 64, logits_processors=(probe,)))
    while not req.output_ids:  # the prefill (chunked or not)
        eng.step()
    for _ in range(warmup):  # decode steps as warm-up (first-use caches, the draft's catch-up)
        eng.step()
    peaks = []
    tracemalloc.start()
    try:
        for _ in range(3):  # the least of 3 steps: Request.context grows in place, and a list's occasional
            base = tracemalloc.get_traced_memory()[0]  # amortised reallocation (1 in ~250 tokens at 2048)
            tracemalloc.reset_peak()  # is not per-step work
            eng.step()
            peaks.append(tracemalloc.get_traced_memory()[1] - base)
    finally:
        tracemalloc.stop()
    peak = min(peaks)
    record = probe.calls[-1]
    if lines is not None:
        lines.extend(_lines(eng.step) for _ in range(2))
    out = list(req.output_ids)
    eng.loop.cancel(req.request_id)
    while eng.has_work():
        eng.step()
    return peak, record, out


def test_host_work_per_decode_step_is_the_same_at_context_64_and_2048(long_pair):
    eng = long_pair
    peak_short, rec_short, out_short = _decode_step_host_work(eng, SHORT)
    peak_long, rec_long, out_long = _decode_step_host_work(eng, LONG)
    assert len(out_short) >= 2 and len(out_long) >= 2
    # the same tree both times: one history per node, each a view of the same small size
    assert rec_short[0] == rec_long[0] == 9, (rec_short, rec_long)
    assert rec_short[1] == rec_long[1], (rec_short, rec_long)
    assert rec_long[2] > LONG  # the view still holds the whole context (prompt + output)
    # Python allocations of the whole step: independent of the context (32x longer here); before the fix the
    # long step allocated > 130 KiB more (a 16 KiB list per node and per context read)
    assert peak_long - peak_short < 4096, (peak_short, peak_long)


def test_host_work_per_decode_step_with_the_ngram_drafter_is_the_same_at_context_64_and_2048(ngram_engine):
    eng = ngram_engine
    lines_short, lines_long = [], []
    # warm-up: 4 steps of one token each before the loop has occurred once, then 5 tokens a step
    peak_short, rec_short, out_short = _decode_step_host_work(eng, SHORT, Loop(), lines_short, warmup=6)
    peak_long, rec_long, out_long = _decode_step_host_work(eng, LONG, Loop(), lines_long, warmup=6)
    # the forced loop, the same in both: the drafter found it (a 4-deep chain, all accepted: 5 tokens a step)
    assert out_short == out_long and out_short[:8] == [250, 251, 252, 253] * 2, (out_short, out_long)
    assert len(out_short) == 40 and rec_short[0] == rec_long[0] == 5, (rec_short, rec_long)
    assert peak_long - peak_short < 4096, (peak_short, peak_long)
    # the same Python work per step, line for line (the old whole-context scan: ~17,900 more at 2048)
    assert lines_short == lines_long, (lines_short, lines_long)


def test_history_view_reads_like_the_list_it_replaces():
    from specstream.stages.speculative.logits import History

    prompt, out, path = [5, 6, 7], [8, 9], (10, 11)
    full = prompt + out + list(path)
    h = History(prompt, out, path)
    assert len(h) == 7 and list(h) == full and h == full
    assert [h[i] for i in range(-7, 7)] == full[-7:] + full
    assert list(h[3:]) == full[3:] and list(h[1:-1]) == full[1:-1] and list(h[::2]) == full[::2]
    assert list(reversed(h[2:])) == full[2:][::-1]
    assert len(h[9:]) == 0 and list(h[5:2]) == []
    cut = History(prompt, out, stop=4)  # a prefill chunk's rows: the first 4 tokens
    assert list(cut) == full[:4] and cut[-1] == 8
    for view in (h, h[2:], h[3:6], cut, h[9:], cut[1:]):  # its pieces, in place: the same tokens, none empty
        pieces = view.segments()
        assert [t for part, lo, hi in pieces for t in part[lo:hi]] == list(view)
        assert all(lo < hi for _, lo, hi in pieces)
    assert h[3:].segments()[0][0] is out and h[3:].segments()[0][1] == 0  # a view of the list, not a copy
    with pytest.raises(IndexError):
        h[7]


def test_visual_attention_gathers_the_spans_before_the_means_bit_for_bit():
    """The executor's visual attention export (spans gathered first, then the means over layers and heads) equals
    the means of the whole ``[B, T, S]`` block gathered afterwards, bit for bit: rows with spans of different
    starts and widths, a row without a span, a row with fewer query rows than the block."""
    from types import SimpleNamespace

    from specstream.stages.speculative.executor import SpeculativeExecutor

    g = torch.Generator().manual_seed(3)
    b, heads, t, s = 5, 4, 7, 300
    attn = {layer: torch.rand((b, heads, t, s), generator=g).softmax(-1) for layer in (1, 3, 2)}
    spans = [(2, 34), None, (10, 74), (0, 16), (5, 37)]
    n_tok = [7, 7, 3, 7, 1]
    rows = [SimpleNamespace(spec=SimpleNamespace(visual_span=sp), tokens=[0] * n) for sp, n in zip(spans, n_tok)]
    got = SpeculativeExecutor._visual_attention(None, rows, attn)
    whole = torch.stack([attn[layer] for layer in sorted(attn)]).mean(0).mean(1)  # [B, T, S]
    for i, sp in enumerate(spans):
        if sp is None:
            assert got[i] is None
            continue
        want = whole[i, : n_tok[i], sp[0]: sp[1]].float()
        assert got[i].shape == want.shape and torch.equal(got[i], want), i


def _verify_ops(eng, prompt: list[int], steps: int, logprobs: bool) -> list[int]:
    """Tensor operator calls (aten, counted by a dispatch mode) in each of ``steps`` decode steps of one greedy
    request: the executor's inputs of the target forward, its verification and commit (the forward itself is not
    counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    counting = [False]

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += counting[0]
            return func(*args, **(kwargs or {}))

    ex = eng.executor
    counts: list[int] = []
    step, forward = ex._forward_and_verify, ex.target.forward_batch

    def uncounted_forward(*args, **kwargs):
        counting[0] = False
        try:
            return forward(*args, **kwargs)
        finally:
            counting[0] = True

    def counted(*args, **kwargs):
        Count.n, counting[0] = 0, True
        with Count():
            out = step(*args, **kwargs)
        counting[0] = False
        counts.append(Count.n)
        return out

    ex._forward_and_verify, ex.target.forward_batch = counted, uncounted_forward
    try:
        req = eng.add_request(eng.make_request(prompt, steps + 1, speculate=False, logprobs=logprobs))
        while eng.has_work():
            eng.step()
    finally:
        del ex._forward_and_verify, ex.target.forward_batch  # the class's methods again
    assert len(req.output_ids) == steps + 1
    return counts[1:]  # the prefill's step left out


def test_a_plain_greedy_step_builds_and_verifies_in_few_tensor_operations(tmp_path):
    """A decode step without drafts, every row greedy, feeds one token per row and commits the argmax of its one
    logits row: the step's own tensor work around the target forward (its inputs, verification, commit) stays a
    few dozen operations (each a few microseconds of dispatch, against a Whisper tiny.en decoder step of a few
    milliseconds), with and without log-probabilities. The general token-tree path it replaces took 157 operations
    (182 with log-probabilities) for the same inputs and result; 28 and 37 now."""
    spec = TinyDecoderSpec(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    target = save_checkpoint(tmp_path / "target", spec.config_dict(), random_decoder_state(spec, seed=4))
    eng = SpeculativeEngine.from_checkpoints(target, [], ngram=False, config=EngineConfig(
        num_slots=1, max_len=256, adaptive=False, cost_aware=False))
    prompt = list(range(3, 19))
    plain = _verify_ops(eng, prompt, 4, logprobs=False)
    with_lp = _verify_ops(eng, prompt, 4, logprobs=True)
    assert len(set(plain)) == 1 and len(set(with_lp)) == 1, (plain, with_lp)  # the same work every step
    assert plain[0] <= 32, plain
    assert with_lp[0] <= plain[0] + 12, (plain, with_lp)
