"""The caption model: the VLM runner of the device loop (:class:`Captioner`), and what an input is by its content.

:class:`Captioner` is the ``"vlm"`` runner (target VLM, drafters, KV cache), its image encoder and its prefill hook;
vision encoding is submitted through the loop's scheduler (a multimodal input of modality ``"image"``), so encode
batches and decode steps are planned together. Decoding uses the target VLM as verifier, a text-only draft LM (the
prompt without its image tokens) and a **temporal drafter** fed with the previous keyframe's caption of the same
video, merged into one token tree. It knows no broker, topic or message schema: the consumers that feed it
(``specstream.pipeline.caption_stages``) and the public API (``specstream.caption``) call it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specstream.errors import CorruptMediaError, SpecstreamError, UnsupportedMediaError
from specstream.schedulers.plan import Request

log = logging.getLogger("specstream.caption")

IMAGE_EXTS = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
VIDEO_EXTS = {".mp4", ".mkv", ".webm", ".mov", ".avi", ".gif", ".m4v"}
#: default size limit of one media input, bytes (command line, keyframe stage, QA stage)
MAX_SOURCE_BYTES = 512 * 1024 * 1024


def sniff_media(path: str) -> str | None:
    """``"video"`` or ``"image"`` by the file's content (a video container's signature, else an image Pillow
    recognises), or None when neither matches or the file cannot be read. Nothing is decoded."""
    from specstream.modalities.image import sniff_image
    from specstream.modalities.sniff import SNIFF_BYTES, sniff_container

    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return None
    if sniff_container(head) is not None:
        return "video"
    return "image" if head and sniff_image(path) is not None else None


def media_kind(path: str, name: str | None = None) -> str:
    """``"image"`` or ``"video"``: by the content of the file at ``path`` (:func:`sniff_media`), else by the
    extension of ``name`` (the name the client gave; default ``path``). An empty or unreadable file goes by its
    extension, so that its loader reports why it cannot be read.

    Raises:
        UnsupportedMediaError: neither the content nor the extension is an image or a video.
    """
    kind = sniff_media(path)
    if kind is not None:
        return kind
    shown = name or path
    ext = Path(shown).suffix.lower()
    if ext in IMAGE_EXTS:
        return "image"
    if ext in VIDEO_EXTS:
        return "video"
    raise UnsupportedMediaError(f"{shown}: neither an image nor a video (by content), and the file type "
                                f"{ext or '(no extension)'!r} is none of the images {sorted(IMAGE_EXTS)} or videos "
                                f"{sorted(VIDEO_EXTS)}")


@dataclass
class CaptionStats:
    captions: int = 0
    tokens: int = 0
    target_steps: int = 0
    decode_s: float = 0.0
    errors: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def tau(self) -> float:
        return self.tokens / self.target_steps if self.target_steps else 0.0


@dataclass
class Frame:
    """An image, or one keyframe of a video, to caption: the full-resolution ``image`` (``[H, W, 3]`` uint8 RGB),
    the ``source`` as shown in its record, and where it is in its video (PTS seconds, frame number)."""

    source: str
    kind: str  # "image" or "video"
    image: Any
    frame_index: int = 0
    timestamp_s: float = 0.0
    scene_score: float = 1.0


@dataclass
class FrameCaption:
    """One frame's caption: its JSONL ``record`` (``specstream caption``'s), the decoded ``tokens`` (the end token
    included when it ended there), ``draft`` (the tokens the next keyframe of the video drafts from: without the
    end token), the target forwards and the decoding time."""

    record: dict
    tokens: list[int]
    draft: list[int]
    target_steps: int
    decode_s: float


class RecordedError(SpecstreamError):
    """An error that already has its record (an input's error from the keyframe stage, a request the engine
    finished with an error): raised to end the frame with that same code and message."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class MapStems:
    """File-name stems of attention maps, one per source and none used twice: ``clip`` for the first
    ``.../clip.*``, then ``clip-2``, ``clip-3``, ..."""

    def __init__(self):
        self._stems: dict[str, str] = {}

    def __call__(self, source: str) -> str:
        from specstream.stages.attention_maps import map_stem

        if source not in self._stems:
            base = map_stem(source)
            taken = set(self._stems.values())
            stem, n = base, 1
            while stem in taken:
                n += 1
                stem = f"{base}-{n}"
            self._stems[source] = stem
        return self._stems[source]


async def caption_frame(captioner: "Captioner", frame: Frame, prompt: str, max_new_tokens: int,
                        qos: str = "interactive", hypothesis: list[int] | None = None, schema: dict | None = None,
                        attention_maps: Path | None = None, map_stem=None) -> FrameCaption:
    """Caption one frame on the captioner's device loop (started by the caller): prompt preparation, the
    schema's grammar when one is given, one decoding request, and with ``attention_maps`` the overlay PNG.
    ``hypothesis``: the previous keyframe's caption of the same video (temporal drafting). ``map_stem``: a
    function ``source -> stem`` for the map's file name (:class:`MapStems`; default the source's stem).

    Raises:
        CorruptMediaError: the image cannot be prepared. RecordedError: the engine finished the request with an
        error. ContextLengthError, InvalidSchemaError, ...: see ``Captioner.make_request`` and ``grammar``.
    """
    try:
        prepared = await asyncio.to_thread(captioner.vlm.prepare, frame.image, prompt)
    except Exception as exc:
        raise CorruptMediaError(f"image preprocessing failed: {exc}") from exc
    procs = ()
    if schema is not None:  # compiled before any decoding: a schema it cannot compile is this frame's error
        grammar = await asyncio.to_thread(captioner.grammar, schema)
        procs = (grammar.constraint(len(prepared.input_ids)),)
    req = captioner.make_request(prepared, max_new_tokens, qos, hypothesis, logits_processors=procs)
    t0 = time.perf_counter()
    vis: list = []  # the target's attention on the image per committed token, filled by the loop
    done = await captioner.loop.submit(req, visual_attention=vis)  # cancelled with the caller: the slot is freed
    decode_s = time.perf_counter() - t0
    if done.error:
        raise RecordedError(done.error.get("code", SpecstreamError.code), done.error.get("message", ""))
    tokens = list(done.output_ids)
    caption = captioner.text(tokens)
    record = {"source": frame.source, "kind": frame.kind, "frame_index": frame.frame_index,
              "timestamp_s": round(frame.timestamp_s, 6), "caption": caption, "tokens": tokens,
              "scene_score": round(frame.scene_score, 6),
              "stats": {"target_steps": done.stats.target_steps,
                        "mean_accepted": round(done.stats.mean_accepted, 6), "tau": round(done.stats.tau, 6)}}
    if schema is not None:
        from specstream.stages.speculative.grammar import structured_output

        record["caption"], record["finish_reason"] = structured_output(caption, done.finish_reason)
    if attention_maps is not None and vis:
        import numpy as np

        from specstream.stages import attention_maps as amaps

        path = await asyncio.to_thread(amaps.save_attention_map, attention_maps, frame.source, frame.frame_index,
                                       frame.image, np.stack(vis), prepared.grid,
                                       stem=map_stem(frame.source) if map_stem is not None else None)
        record["attention_map"] = str(path)
    eos = set(captioner.vlm.eos_token_ids)
    return FrameCaption(record, tokens, [t for t in tokens if t not in eos], done.stats.target_steps, decode_s)


class FrameReader:
    """The frames of one opened input, as they are decoded: an image's one frame, or a video's keyframes (full
    resolution, one at a time, the video decoded in a killable child process). Iterate with ``async for`` inside
    ``async with`` (leaving it, also by cancellation, ends the decoding child). ``frames_decoded`` and
    ``keyframes`` count what was read.

    Args:
        path: the file as opened (``OpenedSource.path``); source: its name in records and messages; kind:
            ``media_kind``'s answer.

    A video's media error (a corrupt stream after a good part) is raised after the keyframes decoded before it.
    """

    def __init__(self, path: str, source: str, kind: str, max_keyframes_per_minute: float | None = None):
        self.path, self.source, self.kind = path, source, kind
        self.max_keyframes_per_minute = max_keyframes_per_minute
        self.frames_decoded = 0
        self.keyframes = 0
        self._cancel = threading.Event()
        self._run = None
        self._it = None
        self._busy = threading.Lock()  # held while a worker thread advances the run

    async def __aenter__(self) -> "FrameReader":
        return self

    async def __aexit__(self, *exc) -> None:
        if self._run is None:
            return
        self._cancel.set()  # a running step stops within one frame

        def close():
            with self._busy:
                self._it.close()  # ends the run's decoding child (a no-op after the last keyframe)

        # also on cancellation (Ctrl-C, a closed iterator): a thread cannot be cancelled, so stop its decode loop
        # and close the run in a thread (the default executor, which asyncio.run waits for)
        await asyncio.shield(asyncio.to_thread(close))
        self.frames_decoded += self._run.stats.frames_decoded
        self._run = None

    async def __aiter__(self):
        if self.kind == "image":
            from specstream.modalities.image import load_image

            image = await asyncio.to_thread(load_image, self.path)
            self.frames_decoded += 1
            self.keyframes += 1
            yield Frame(self.source, "image", image)
            return
        from specstream.stages.keyframes import select_keyframes

        self._run = select_keyframes(self.path, max_keyframes_per_minute=self.max_keyframes_per_minute,
                                     cancel=self._cancel)
        self._it = iter(self._run)

        def step():
            with self._busy:
                try:
                    return next(self._it, None), None
                except SpecstreamError as exc:  # raised after the keyframes of the part that decoded
                    return None, exc

        while True:
            kf, error = await asyncio.to_thread(step)
            if error is not None:
                raise error
            if kf is None:
                return
            self.keyframes += 1
            yield Frame(self.source, "video", kf.image, kf.frame_index, float(kf.timestamp_s),
                        float(kf.scene_score))


class Captioner:
    """The caption model in the device loop: a ``"vlm"`` runner (target VLM, drafters, KV cache), its image
    encoder and its prefill hook.

    A caption request carries its prepared image as a multimodal input (``Request.mm_inputs``); the loop's
    scheduler batches image encodes with everyone's decode steps, the runner's encoder stores the vision tower's
    features in the request's record, and the prefill hook turns them into the prompt embeddings.

    Args:
        target: LLaVA-family checkpoint (dir or hub id).
        drafts: draft checkpoints (text LMs, or VLMs whose language model drafts text-only).
        tree: draft tree shape (``TreeSpec``).
        temporal: draft from the previous keyframe's caption of the same video.
        visual_aware: smaller trees where the target attends strongly to the image.
        num_slots, max_len: the runner's KV cache sizes.
        loop: the device loop to join (the process's one loop); None: a loop of its own (a one-model process).
        name: the model's name in the loop (requests name it).
    """

    def __init__(self, target, drafts=(), tree=None, temporal: bool = True, ngram: bool = False,
                 visual_aware: bool = True, num_slots: int = 8, max_len: int = 1024, dtype: str = "float32",
                 device: str = "cpu", attention_maps: bool = False, loop=None, name: str = "vlm"):
        from specstream.stages.device_loop import DeviceLoop, ModelRunner, new_qos_scheduler
        from specstream.stages.speculative.drafters.model import ModelDrafter, TreeSpec
        from specstream.stages.speculative.drafters.ngram import NgramDrafter
        from specstream.stages.speculative.drafters.temporal import TemporalDrafter
        from specstream.stages.speculative.executor import SpeculativeExecutor
        from specstream.stages.speculative.models.checkpoint import check_same_tokenizer, resolve_checkpoint
        from specstream.stages.speculative.models.loader import load_decoder
        from specstream.stages.speculative.models.vlm import VisionLanguageModel

        tree = tree or TreeSpec()
        self.vlm = VisionLanguageModel(target, dtype, device)
        dec = self.vlm.decoder
        self._grammars: dict[str, object] = {}  # schema JSON text -> compiled Grammar
        self._grammar_lock = threading.Lock()
        max_len = min(max_len, dec.config.max_position_embeddings)
        vocab_limit = min(len(self.vlm.tokenizer), dec.config.vocab_size)
        drafters = []
        self.temporal = TemporalDrafter(max_depth=tree.depth) if temporal else None
        if self.temporal is not None:
            drafters.append(self.temporal)
        for i, d in enumerate(drafts):
            ck = resolve_checkpoint(d)
            check_same_tokenizer(self.vlm.checkpoint, ck)
            drafters.append(ModelDrafter(load_decoder(ck, dtype, device), num_slots, max_len, tree,
                                         vocab_limit=vocab_limit, target_vocab=dec.config.vocab_size,
                                         name=f"draft{i}"))
        if ngram:
            drafters.append(NgramDrafter(max_depth=tree.depth))
        full = max(tree.num_nodes(), 9)
        executor = SpeculativeExecutor(dec, drafters, num_slots, max_len, full_nodes=full, adaptive=True,
                                       visual_aware=visual_aware)
        # results are idempotent by (id, seq): a redelivered frame must repeat its stats, so tree sizes must not
        # depend on timing
        executor.cost_aware = False
        self.runner = ModelRunner(name, executor, None, tuple(self.vlm.eos_token_ids), max_len,
                                  encoder_bytes=num_slots * self._features_bytes())
        self.runner.register_encoder("image", self._encode)
        self.runner.set_prefill_hook(self._prefill_inputs)
        if loop is None:
            sched = new_qos_scheduler(token_budget=max(4096, num_slots * (full + 1)), max_nodes_per_request=full,
                                      max_tree_depth=tree.depth)
            loop = DeviceLoop([], sched, device=str(device))
        loop.add_runner(self.runner)
        self.loop = loop
        self.export_attention = attention_maps or visual_aware
        self._ids = itertools.count()
        #: seconds spent in the vision tower (the runner's image encoder), over the captioner's life
        self.encode_s = 0.0

    def _features_bytes(self) -> int:
        """Bytes of one image's prompt embeddings (visual tokens x hidden x 4), the memory budget's estimate."""
        cfg = self.vlm.decoder.config
        return int(getattr(self.vlm, "image_seq_length", 576) or 576) * cfg.hidden_size * 4

    def _encode(self, items) -> None:
        """The runner's image encoder: one vision-tower batch; features into each request's record."""
        t0 = time.perf_counter()
        feats = self.vlm.encode([mm.data for _, mm in items])
        for (state, mm), f in zip(items, feats):
            state.mm_outputs[mm.item_id] = f
        self.encode_s += time.perf_counter() - t0

    def _prefill_inputs(self, state) -> None:
        """The runner's prefill hook: the request's image features spliced into its prompt embeddings."""
        for m in state.spec.mm_inputs:  # one input per prompt: all its images (vlm.encode concatenates them)
            if m.item_id in state.mm_outputs:
                state.prefix_embeds = self.vlm.prompt_embeds(m.data, state.mm_outputs[m.item_id])

    @property
    def executor(self):
        return self.runner.executor

    def make_request(self, prepared, max_new_tokens: int, qos: str = "interactive",
                     hypothesis: list[int] | None = None, *, sampling=None, logprobs: bool = False,
                     logits_processors=()) -> Request:
        """A request for one prepared prompt (its images, one or several, or none; not yet queued). Its images
        travel as one multimodal input, encoded by the runner's image encoder. ``sampling`` (default greedy),
        ``logprobs`` and ``logits_processors`` are passed to ``ModelRunner.make_request``.

        Raises:
            ContextLengthError: the prompt with its image tokens leaves no room for a new token.
            InvalidRequestError: see ``ModelRunner.make_request``.
        """
        from specstream.schedulers.plan import MMInput

        rid = f"cap-{next(self._ids)}"
        span = None
        if self.export_attention and prepared.visual_positions:
            pos = prepared.visual_positions
            if pos[-1] - pos[0] + 1 == len(pos):
                span = (pos[0], pos[-1] + 1)
        mm = ()
        if prepared.num_images:
            mm = (MMInput(f"{rid}/img", "image", prepared, float(prepared.num_images),
                          len(prepared.visual_positions or ()) * self.vlm.decoder.config.hidden_size * 4),)
        return self.runner.make_request(prepared.input_ids, max_new_tokens, sampling, request_id=rid, qos=qos,
                                        mm_inputs=mm, draft_prompt_ids=prepared.draft_ids, visual_span=span,
                                        logprobs=logprobs, logits_processors=logits_processors,
                                        draft_hypothesis=tuple(hypothesis) if self.temporal is not None
                                        and hypothesis else None)

    def grammar(self, schema: dict):
        """The compiled grammar of a JSON Schema over the VLM's vocabulary (cached per schema; thread-safe;
        the first call also builds the vocabulary table, about a second for GPT-2's).

        Raises:
            InvalidSchemaError, SchemaCompileTimeoutError (``stages/speculative/grammar.py``).
        """
        import json

        from specstream.stages.speculative.grammar import Grammar, tokenizer_info

        key = json.dumps(schema, sort_keys=True)
        with self._grammar_lock:
            g = self._grammars.get(key)
            if g is None:
                info = tokenizer_info(self.vlm.tokenizer, self.vlm.decoder.config.vocab_size, self.vlm.eos_token_ids)
                g = self._grammars[key] = Grammar.from_json_schema(schema, info)
            return g

    def text(self, tokens: list[int]) -> str:
        eos = set(self.vlm.eos_token_ids)
        return self.vlm.decode_text([t for t in tokens if t not in eos]).strip()
