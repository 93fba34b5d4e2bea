"""The step stays on the device: host syncs per step are counted; per-request state is dropped in one place;
NaN stays local to its request; the draft's KV commit survives merged trees."""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode

from conftest import hf_greedy
from specstream.types import SamplingParams
from specstream.schedulers.qos import QosConfig, QosScheduler
from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
from specstream.stages.speculative.engine import EngineConfig, SpeculativeEngine

G = torch.Generator().manual_seed(77)
PROMPTS = [torch.randint(0, 250, (n,), generator=G).tolist() for n in (3, 9, 14, 6)]


class HostSyncs(TorchFunctionMode):
    """Counts every call that copies a tensor's value to the host (item, tolist, cpu, numpy, bool/int/float/
    index conversions, ``.to("cpu")``), on CPU tensors too."""

    NAMES = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES:
            self.counts[name] += 1
        elif name == "to" and any(str(a) == "cpu" for a in list(args[1:]) + list((kwargs or {}).values())):
            self.counts["to(cpu)"] += 1  # a copy to the host (a no-op only when the tensor is there already)
        return func(*args, **(kwargs or {}))

    def total(self) -> int:
        return sum(self.counts.values())


def _engine(tiny, drafts=("noisy",), ngram=False, tree="1,1,3,1", dtype="float32", **kw):
    paths = {"same": tiny.same, "noisy": tiny.noisy, "random": tiny.random}
    cfg = EngineConfig(**{"num_slots": 8, "max_len": 128, "tree": TreeSpec.parse(tree), "adaptive": False, **kw})
    return SpeculativeEngine.from_checkpoints(tiny.target, [paths[d] for d in drafts], ngram=ngram, config=cfg,
                                              dtype=dtype)


SYNC_CASES = {
    "greedy-tree": (("noisy",), False, "1,1,3,1", "greedy"),
    "greedy-merged": (("noisy", "same"), True, "2,1,2", "greedy"),
    "sampled-merged": (("noisy", "same"), True, "3,2,1", "sample"),
    "dynamic": (("noisy",), False, "dynamic:12", "greedy"),
    "no-speculation": ((), False, "1", "greedy"),
    # the quantized paths (kernels/quant.py): the same budget of host syncs
    "int8-greedy-merged": (("noisy", "same"), True, "2,1,2", "greedy", "int8"),
    "int4-sampled-merged": (("noisy", "same"), True, "3,2,1", "sample", "int4"),
    "bf16-greedy-tree": (("noisy",), False, "1,1,3,1", "greedy", "bfloat16"),
}


@pytest.mark.parametrize("name", sorted(SYNC_CASES))
def test_host_syncs_per_step_at_most_one_per_draft_depth_and_one_per_verify(tiny, name):
    drafts, ngram, tree, mode, *dtype = SYNC_CASES[name]
    eng = _engine(tiny, drafts, ngram, tree, dtype=(dtype or ["float32"])[0])
    spec = TreeSpec.parse(tree)
    for i, p in enumerate(PROMPTS):
        eng.add_request(eng.make_request(p, 20, SamplingParams(mode, temperature=0.9, seed=i)))
    per_step = []
    while eng.has_work():
        with HostSyncs() as syncs:
            eng.step()
        per_step.append(syncs.counts)
    depth = spec.depth if drafts else 0
    assert len(per_step) >= 5
    for counts in per_step:
        assert sum(counts.values()) <= depth * len(drafts) + 1, counts
        assert set(counts) <= {"tolist"}, counts  # one batched copy each; nothing per node or per request
    assert max(sum(c.values()) for c in per_step) >= 1


def _leaks(eng, ids) -> list[str]:
    """Attributes of the engine, its executor, scheduler and drafters that still hold one of ``ids``."""
    found = []
    objs = {"engine": eng, "executor": eng.executor, "scheduler": eng.scheduler}
    objs.update({f"drafter{i}": d for i, d in enumerate(eng.executor.drafters)})
    for where, obj in objs.items():
        for name, value in vars(obj).items():
            if isinstance(value, dict) and any(i in value for i in ids):
                found.append(f"{where}.{name}")
            if isinstance(value, (list, set, tuple)) and any(i in value for i in ids if isinstance(i, str)):
                found.append(f"{where}.{name}")
    return found


def test_no_per_request_state_survives_finished_failed_and_preempted_requests(tiny, tmp_path):
    """Requests that finish, fail (NaN logits) or are preempted and resumed leave nothing behind."""
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny.target, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.embed_tokens.weight"][252] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    sched = QosScheduler(QosConfig(num_slots=2, max_len=128, reserved_realtime_slots=0, max_nodes_per_request=8))
    cfg = EngineConfig(num_slots=2, max_len=128, tree=TreeSpec.parse("1,1,2"), ngram=True, cost_aware=False)
    eng = SpeculativeEngine.from_checkpoints(bad, [tiny.noisy], ngram=True, config=cfg)
    eng.scheduler = sched
    reqs = [eng.make_request(PROMPTS[0], 24, qos="batch", request_id="batch-a"),
            eng.make_request(PROMPTS[1], 24, qos="batch", request_id="batch-b"),
            eng.make_request([3, 252, 4], 6, request_id="nan"),
            eng.make_request(PROMPTS[2], 8, qos="realtime", request_id="rt", logprobs=True,
                             sampling=SamplingParams("sample", seed=5))]  # never samples the NaN token
    for r in reqs[:2]:
        eng.add_request(r)
    for _ in range(3):
        eng.step()
    for r in reqs[2:]:
        eng.add_request(r)
    eng.run()
    assert reqs[2].error["code"] == "numerical_error"
    assert [r.error for r in reqs[:2] + reqs[3:]] == [None, None, None], [(r.request_id, r.output_ids) for r in reqs]
    assert reqs[0].preemptions + reqs[1].preemptions >= 1  # the realtime request preempted a batch one
    for r in reqs:
        eng.scheduler.pop_finished(r.request_id)
    ids = [r.request_id for r in reqs]
    assert _leaks(eng, ids) == []
    assert eng.executor.states == {} and eng.loop._entries == {}
    assert eng.executor.cache.lengths == [0, 0]
    assert all(d.cache.lengths == [0, 0] for d in eng.executor.drafters if isinstance(d, ModelDrafter))


def _nan_target(tiny, tmp_path, token: int):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / f"nan{token}"
    shutil.copytree(tiny.target, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.embed_tokens.weight"][token] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    return bad


def test_nan_on_a_rejected_branch_changes_nothing(tiny, tmp_path, hf_target):
    """A drafted branch through a token whose embedding is NaN is rejected; the request and its batch
    neighbour decode exactly as the target alone, also in later steps (the branch's stale cache columns were
    zeroed, so a longer neighbour's attention span never reads them)."""
    nan_tok = 253
    prompt, neighbour = PROMPTS[0], PROMPTS[2] + PROMPTS[1]
    want = hf_greedy(hf_target, prompt, 16)
    want_n = hf_greedy(hf_target, neighbour, 16)
    assert nan_tok not in want
    eng = SpeculativeEngine.from_checkpoints(_nan_target(tiny, tmp_path, nan_tok), [],
                                             config=EngineConfig(num_slots=2, max_len=128, adaptive=False))
    from specstream.stages.speculative.drafters.temporal import TemporalDrafter

    eng.executor.drafters.append(TemporalDrafter(max_ngram=1, max_branches=2, max_depth=4))
    eng.executor.full_nodes = 9
    # the hypothesis proposes, after the prompt's last token, the NaN token first and the right tokens second
    hyp = (prompt[-1], nan_tok, nan_tok, nan_tok) + tuple(want[:6]) + (prompt[-1],) + tuple(want[:4])
    bad = eng.add_request(eng.make_request(prompt, 16, draft_hypothesis=hyp))
    good = eng.add_request(eng.make_request(neighbour, 16))
    eng.run()
    assert bad.error is None and good.error is None
    assert bad.output_ids == want and good.output_ids == want_n
    assert sum(bad.stats.accepted_per_step) >= 3  # the right branch beside the NaN one was accepted


def test_nan_on_the_committed_path_fails_only_that_request_and_clears_its_slot(tiny, tmp_path, hf_target):
    nan_tok = 250
    eng = SpeculativeEngine.from_checkpoints(_nan_target(tiny, tmp_path, nan_tok), [tiny.same],
                                             config=EngineConfig(num_slots=2, max_len=128))
    good = eng.add_request(eng.make_request(PROMPTS[1], 12))
    poisoned = eng.add_request(eng.make_request([3, nan_tok, 4], 12))
    eng.run()
    assert poisoned.error == {"code": "numerical_error", "message": "the target produced NaN or infinite logits"}
    assert good.error is None and good.output_ids == hf_greedy(hf_target, PROMPTS[1], 12)
    slot = poisoned.slot
    assert torch.count_nonzero(eng.executor.cache.k[:, slot]) == 0  # cleared, not only forgotten
    assert torch.isfinite(eng.executor.cache.k).all() and torch.isfinite(eng.executor.cache.v).all()
    # the slot's next request decodes exactly (two requests: both slots are taken again)
    again = eng.generate([PROMPTS[3], PROMPTS[0]], 10)
    assert slot in {r.slot for r in again}
    assert [r.output_ids for r in again] == [hf_greedy(hf_target, p, 10) for p in (PROMPTS[3], PROMPTS[0])]


def test_nan_in_the_draft_never_fails_a_request(tiny, tmp_path, hf_target):
    from safetensors.numpy import load_file, save_file

    bad = tmp_path / "nandraft"
    shutil.copytree(tiny.noisy, bad)
    state = load_file(str(bad / "model.safetensors"))
    state["model.layers.0.mlp.down_proj.weight"][:] = float("nan")
    save_file(state, str(bad / "model.safetensors"), metadata={"format": "pt"})
    eng = SpeculativeEngine.from_checkpoints(tiny.target, [bad], ngram=True,
                                             config=EngineConfig(num_slots=2, max_len=128, adaptive=False))
    reqs = eng.generate(PROMPTS[:2], 12)
    for p, r in zip(PROMPTS[:2], reqs):
        assert r.error is None and r.output_ids == hf_greedy(hf_target, p, 12)


def test_draft_kv_commit_after_merged_trees(tiny):
    """With the n-gram drafter merged in, the draft still keeps the keys/values of the accepted tokens it fed:
    each step it re-reads only the bonus token and an accepted leaf it never fed (at most 2 per step)."""
    for ngram in (False, True):
        eng = _engine(tiny, ("same",), ngram, "1,1,1,1")
        req = eng.generate([PROMPTS[1] * 2], 40)[0]
        draft = eng.executor.drafters[0]
        steps = req.stats.target_steps - 1
        assert req.stats.mean_accepted > 3
        assert draft.catch_up_tokens <= len(PROMPTS[1]) * 2 + 2 * steps, (ngram, draft.catch_up_tokens, steps)
