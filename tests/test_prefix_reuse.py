"""A slot's cached prompt prefix is reused by the slot's next request: exact, and only the rest is read."""

from __future__ import annotations

import pytest
import torch

from conftest import hf_greedy
from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

G = torch.Generator().manual_seed(77)
SHARED = torch.randint(0, 256, (24,), generator=G).tolist()  # a system prompt
TAILS = [torch.randint(0, 256, (n,), generator=G).tolist() for n in (5, 9, 3)]
PROMPTS = [SHARED + t for t in TAILS]


def engine(tiny, reuse: bool, slots: int = 1):
    cfg = EngineConfig(num_slots=slots, max_len=128, tree=TreeSpec.parse("1,1,1"), adaptive=False,
                       prefix_reuse=reuse)
    return SpeculativeEngine.from_checkpoints(tiny.target, [tiny.noisy], config=cfg)


def test_a_shared_prompt_prefix_is_read_once_and_the_output_is_the_target_s(tiny, hf_target):
    """One slot, three requests one after another, each the 24-token shared prefix + its own tail: the second
    and third prefill only their tails in the target and in the draft (the draft's catch-up reads its tail and
    the tokens of the steps), and every output is Hugging Face's greedy output; with reuse off both read
    everything."""
    reads = {}
    for reuse in (True, False):
        eng = engine(tiny, reuse)
        draft = next(d for d in eng.executor.drafters if isinstance(d, ModelDrafter))
        ex = eng.executor
        per = []
        for prompt in PROMPTS:
            r0, c0 = ex.prefix_reused_tokens, draft.catch_up_tokens
            (req,) = eng.generate([prompt], 12)
            assert req.output_ids == hf_greedy(hf_target, prompt, 12)
            per.append((ex.prefix_reused_tokens - r0, draft.catch_up_tokens - c0))
        reads[reuse] = per
        assert ex.prefill_tokens == sum(len(p) for p in PROMPTS)  # what the plans booked, either way
    on, off = reads[True], reads[False]
    assert [r for r, _ in on] == [0, len(SHARED), len(SHARED)]
    assert [r for r, _ in off] == [0, 0, 0]
    # the draft: the same reads but for the shared prefix
    assert [c_off - c_on for (_, c_on), (_, c_off) in zip(on, off)] == [0, len(SHARED), len(SHARED)]


def test_the_same_prompt_again_reuses_all_but_its_last_token(tiny, hf_target):
    eng = engine(tiny, True)
    prompt = PROMPTS[0]
    first = eng.generate([prompt], 8)[0].output_ids
    before = eng.executor.prefix_reused_tokens
    again = eng.generate([prompt], 8)[0].output_ids
    assert first == again == hf_greedy(hf_target, prompt, 8)
    assert eng.executor.prefix_reused_tokens - before == len(prompt) - 1  # the last token runs: its logits row


@pytest.mark.parametrize("how", ["failed", "other-prefix"])
def test_nothing_is_reused_from_a_failed_request_or_past_the_common_prefix(tiny, hf_target, how):
    eng = engine(tiny, True)
    ex = eng.executor
    eng.generate([PROMPTS[0]], 6)
    if how == "failed":
        ex.fail("gone", 0)  # what a failed request's slot goes through: zeroed, nothing remembered
        nxt, want = PROMPTS[1], 0
    else:
        nxt = SHARED[:10] + [(SHARED[10] + 1) % 256] + SHARED[11:] + TAILS[1]
        want = 10
    before = ex.prefix_reused_tokens
    (req,) = eng.generate([nxt], 8)
    assert req.output_ids == hf_greedy(hf_target, nxt, 8)
    assert ex.prefix_reused_tokens - before == want


def test_a_batch_reuses_per_slot(tiny, hf_target):
    """Four requests on two slots, two rounds: each request of the second round finds the shared prefix in the
    slot it lands in."""
    eng = engine(tiny, True, slots=2)
    eng.generate(PROMPTS[:2], 6)
    before = eng.executor.prefix_reused_tokens
    reqs = eng.generate([PROMPTS[2], PROMPTS[0]], 6)
    for prompt, req in zip([PROMPTS[2], PROMPTS[0]], reqs):
        assert req.output_ids == hf_greedy(hf_target, prompt, 6)
    assert eng.executor.prefix_reused_tokens - before >= 2 * len(SHARED)


def test_a_kv_commit_that_raises_leaves_the_slot_lengths_as_they_were():
    """A freed slot's length says which prefix its next request may reuse, so it must never cover columns that
    still hold tree nodes: when the compaction's copy fails (a device error), the lengths stay where they were."""
    from specstream.stages.speculative.models.kv_cache import KVCache

    cache = KVCache(num_layers=2, num_slots=2, num_kv_heads=1, max_len=16, head_dim=4, dtype=torch.float32,
                    device="cpu")
    cache.lengths[:] = [5, 3]

    class Broken:
        shape, device = cache.k.shape, cache.k.device

        def __getitem__(self, index):
            raise RuntimeError("device copy failed")

        __setitem__ = __getitem__

    cache.k = Broken()
    with pytest.raises(RuntimeError, match="device copy failed"):
        cache.compact_batch([0, 1], [5, 3], [[7, 9], [3]])  # slot 0 keeps two tree nodes, slot 1 its root in place
    assert cache.lengths == [5, 3]


def test_the_device_loop_exports_prefill_and_reused_tokens(tiny):
    """``/metrics`` (the scheduler's registry): prompt tokens planned as prefill and those a slot still held."""
    from specstream.schedulers.metrics import SchedulerMetrics
    from specstream.schedulers.qos import QosConfig, QosScheduler

    eng = engine(tiny, True)
    metrics = SchedulerMetrics()
    eng.scheduler = QosScheduler(QosConfig(num_slots=1, max_len=128, reserved_realtime_slots=0), metrics=metrics)
    for prompt in PROMPTS[:2]:
        eng.generate([prompt], 4)
    text = metrics.render().decode()
    assert f'specstream_scheduler_prefill_tokens_total{{model="default"}} {float(len(PROMPTS[0]) + len(PROMPTS[1]))}' \
        in text
    assert f'specstream_scheduler_prefix_reused_tokens_total{{model="default"}} {float(len(SHARED))}' in text
