"""The speculative decoding engine: one model in a device loop, a scheduler and an executor in a three-call step.

``step()`` = ``scheduler.schedule() -> StepPlan``; ``executor.execute(plan) -> StepOutput``;
``scheduler.update(output)`` (:class:`~specstream.stages.device_loop.DeviceLoop`). The scheduler decides
(admission, tree budgets), the executor runs tensors.
Requests join and leave between steps (continuous batching); each request's output is exactly what the target
alone would produce (greedy: token for token; sampling: in distribution).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from specstream.types import SamplingParams
from specstream.schedulers.fifo import FifoScheduler
from specstream.schedulers.plan import Request
from specstream.stages.speculative.drafters.base import Drafter
from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
from specstream.stages.speculative.drafters.ngram import NgramDrafter
from specstream.stages.speculative.executor import SpeculativeExecutor
from specstream.stages.speculative.logits import LogitsProcessor
from specstream.stages.speculative.models.llama import LlamaDecoder
from specstream.stages.speculative.models.checkpoint import check_same_tokenizer, resolve_checkpoint
from specstream.stages.speculative.models.loader import load_decoder

TokenCallback = Callable[[Request, tuple[int, ...]], None]


@dataclass
class EngineConfig:
    """Engine sizes.

    Attributes:
        num_slots: concurrent requests (KV cache slots).
        max_len: context per slot in tokens (capped by the model's ``max_position_embeddings``).
        tree: the model drafters' tree shape.
        max_nodes_per_request: largest tree granted (root included); default: the tree's full size.
        token_budget: tree nodes + prefill tokens verified per step across the batch.
        adaptive: shrink trees of requests with low recent acceptance.
        visual_aware: shrink trees where a VLM target attends strongly to the image (requests with a visual span).
        cost_aware: weigh acceptance against the measured draft/verify time (faster, but tree sizes and so the
            stats then depend on timing; off where results must repeat identically, e.g. Kafka redeliveries).
        attention_layers: layers whose attention on visual tokens is exported (None: the second half).
        ngram: add the n-gram (prompt lookup) drafter.
        prefix_reuse: a request's prefill skips the leading prompt tokens whose keys/values its slot still holds
            from the slot's previous request (a shared system prompt, a repeated prompt), in the target and in
            the draft models; text decoders only (``docs/architecture.md``).
    """

    num_slots: int = 16
    max_len: int = 1024
    tree: TreeSpec = field(default_factory=TreeSpec)
    max_nodes_per_request: int | None = None
    token_budget: int = 8192
    adaptive: bool = True
    ngram: bool = False
    visual_aware: bool = False
    cost_aware: bool = True
    attention_layers: tuple[int, ...] | None = None
    prefix_reuse: bool = True


class SpeculativeEngine:
    """Token-tree speculative decoding over a continuous batch (SpecInfer, Miao et al., ASPLOS 2024), one model.

    A one-model :class:`~specstream.stages.device_loop.DeviceLoop` (model ``"default"``) stepped in the caller's
    thread: the library API for scripts and tests. Servers and the CLI put every model of the process into the
    device's one loop instead (:func:`~specstream.stages.device_loop.device_loop`).

    Build with :meth:`from_checkpoints` or from a loaded target and drafters.
    """

    def __init__(self, target: LlamaDecoder, drafters: list[Drafter], config: EngineConfig | None = None,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None, scheduler=None, name: str = "default"):
        from specstream.stages.device_loop import DeviceLoop, ModelRunner

        self.config = config or EngineConfig()
        self.target = target
        self.max_len = min(self.config.max_len, target.config.max_position_embeddings)
        full = self.config.max_nodes_per_request or max(
            [self.config.tree.num_nodes()] + [9 for d in drafters if isinstance(d, NgramDrafter)]
        )
        executor = SpeculativeExecutor(target, drafters, self.config.num_slots, self.max_len, full_nodes=full,
                                       adaptive=self.config.adaptive,
                                       attention_layers=self.config.attention_layers,
                                       visual_aware=self.config.visual_aware)
        executor.cost_aware = self.config.cost_aware
        executor.prefix_reuse = executor.prefix_reuse and self.config.prefix_reuse
        self.eos_token_ids = tuple(eos_token_ids)
        self.tokenizer = tokenizer
        self.vocab_limit = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer else target.config.vocab_size
        self.runner = ModelRunner(name, executor, tokenizer, self.eos_token_ids, self.max_len,
                                  requires_encoder_output=getattr(target, "requires_encoder_output", False))
        self.loop = DeviceLoop([self.runner], scheduler or FifoScheduler(
            self.config.num_slots, self.max_len, max_nodes_per_request=full, token_budget=self.config.token_budget))

    @property
    def executor(self) -> SpeculativeExecutor:
        return self.runner.executor

    @property
    def scheduler(self):
        return self.loop.scheduler

    @scheduler.setter
    def scheduler(self, value) -> None:
        self.loop.scheduler = value

    # -- construction ---------------------------------------------------------------------------------------
    @classmethod
    def from_checkpoints(cls, target: str | os.PathLike, drafts: list[str | os.PathLike] = (), ngram: bool = False,
                         config: EngineConfig | None = None, dtype: str = "float32", device: str = "cpu",
                         draft_dtype: str | None = None):
        """Load a target and draft checkpoints (dirs or hub ids) and build an engine.

        With no drafts and ``ngram`` False, no speculation happens (one token per target step). ``draft_dtype``
        (default: ``dtype``) may be lower than the target's: a draft's precision changes how often its tokens
        are accepted, never what is committed.

        ``dtype`` / ``draft_dtype``: weight precision (``dtypes.weight_format``): float32, bfloat16, int8, int4,
        int4-g64; greedy output equals this engine at the same precision without speculation.

        Raises:
            CheckpointNotFoundError, UnsupportedArchitectureError, TokenizerMismatchError, UnsupportedDtypeError.
        """
        config = config or EngineConfig()
        tckpt = resolve_checkpoint(target, dtype=str(dtype))
        tmodel = load_decoder(tckpt, dtype, device)
        tokenizer = tckpt.tokenizer
        vocab_limit = tokenizer.get_vocab_size(with_added_tokens=True) if tokenizer else tmodel.config.vocab_size
        max_len = min(config.max_len, tmodel.config.max_position_embeddings)
        drafters: list[Drafter] = []
        for i, d in enumerate(drafts):
            dckpt = resolve_checkpoint(d, dtype=str(draft_dtype or dtype))
            check_same_tokenizer(tckpt, dckpt)
            dmodel = load_decoder(dckpt, draft_dtype or dtype, device)
            drafters.append(ModelDrafter(dmodel, config.num_slots, max_len, config.tree,
                                         vocab_limit=min(vocab_limit, tmodel.config.vocab_size),
                                         target_vocab=tmodel.config.vocab_size, name=f"draft{i}"))
        if ngram or config.ngram:
            drafters.append(NgramDrafter(max_depth=max(1, config.tree.depth)))
        engine = cls(tmodel, drafters, config, tckpt.eos_token_ids(), tokenizer)
        engine.checkpoint = tckpt
        return engine

    def reconfigured(self, config: EngineConfig, drafts: bool = True, ngram: bool = False) -> SpeculativeEngine:
        """A new engine over this engine's loaded weights (the target, and the draft models when ``drafts``) with
        ``config``: new KV caches (``config.num_slots`` x ``config.max_len``), a new scheduler and a new n-gram
        drafter when ``ngram`` or ``config.ngram``. Nothing is read from disk again. The two engines share the weights,
        not their state; use one at a time from one thread, as with any engine."""
        models = [d for d in self.executor.drafters if isinstance(d, ModelDrafter)] if drafts else []
        max_len = min(config.max_len, self.target.config.max_position_embeddings)
        drafters: list[Drafter] = [
            ModelDrafter(d.model, config.num_slots, max_len, config.tree, vocab_limit=d.vocab_limit,
                         target_vocab=d.target_vocab, name=d.name) for d in models]
        if ngram or config.ngram:
            drafters.append(NgramDrafter(max_depth=max(1, config.tree.depth)))
        engine = type(self)(self.target, drafters, config, self.eos_token_ids, self.tokenizer)
        engine.checkpoint = getattr(self, "checkpoint", None)
        return engine

    # -- requests -------------------------------------------------------------------------------------------
    def make_request(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                     request_id: str | None = None, speculate: bool = True,
                     logits_processors: Sequence[LogitsProcessor] = (), **kwargs) -> Request:
        """Validate and build a request (not yet queued).

        ``logits_processors`` rewrite the target's scores before argmax / sampling, per tree node along its own
        path (:mod:`specstream.stages.speculative.logits`).

        Raises:
            InvalidRequestError: empty prompt, ids outside the vocabulary, ``max_new_tokens < 1``.
            ContextLengthError: the prompt leaves no room for a new token.
        """
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
        return self.runner.make_request(prompt_ids, max_new_tokens, sampling, request_id, speculate,
                                        logits_processors, **kwargs)

    @property
    def _ids(self):
        return self.runner._ids

    def add_request(self, request: Request, on_tokens: TokenCallback | None = None,
                    encoder_output: torch.Tensor | None = None) -> Request:
        """Queue a request; ``on_tokens(request, new_tokens)`` is called after every step that commits tokens.

        Args:
            encoder_output: ``[S_enc, d_model]`` for encoder-decoder targets (Whisper): handed to
                ``target.set_encoder_output(cache, slot, encoder_output)`` when the request is prefilled. A
                request with multimodal inputs may leave it None: the runner's encoder computes it.

        Raises:
            InvalidRequestError: an encoder output for a decoder-only target, or none for a target that
                requires one.
        """
        return self.loop.add_request(request, on_tokens, encoder_output)

    # -- the loop -------------------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One engine step; returns requests that finished in it."""
        return self.loop.step()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def run(self) -> None:
        """Step until every queued request finished."""
        while self.has_work():
            self.step()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, sampling: SamplingParams | None = None,
                 speculate: bool = True) -> list[Request]:
        """Decode ``prompts`` as one continuous batch; returns the finished requests in input order."""
        reqs = [self.add_request(self.make_request(p, max_new_tokens, sampling, speculate=speculate))
                for p in prompts]
        self.run()
        for r in reqs:
            self.loop.pop(r.request_id)
        return reqs

    def stream(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None
               ) -> Iterator[tuple[int, ...]]:
        """Yield each step's committed tokens for one request (other queued requests advance too)."""
        chunks: list[tuple[int, ...]] = []
        req = self.add_request(self.make_request(prompt_ids, max_new_tokens, sampling),
                               on_tokens=lambda r, toks: chunks.append(toks))
        while not req.finished:
            self.step()
            while chunks:
                yield chunks.pop(0)
        self.loop.pop(req.request_id)

    @property
    def target_forwards(self) -> int:
        return self.executor.target_forwards

    def decode_text(self, ids: list[int]) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([i for i in ids if i < self.vocab_limit])


