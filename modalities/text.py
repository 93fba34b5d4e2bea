"""Text in and out of a decoder: chat templates, and streamed token ids turned into text.

- :func:`chat_prompt_ids` renders a checkpoint's chat template around one user message and tokenises it exactly as
  Hugging Face ``apply_chat_template(..., add_generation_prompt=True)`` does (transformers renders it; the
  template is the checkpoint's own, e.g. ChatML for Qwen2.5).
- :class:`IncrementalDetokenizer` turns token ids, as they are committed, into text deltas that never split a
  multi-byte UTF-8 character: byte-level BPE vocabularies spread one character over several tokens, and decoding
  a partial character gives U+FFFD. The text is held back until the character is complete, in the manner of
  vLLM's incremental detokenizer (a prefix window re-decoded with the new tokens).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

from specstream.errors import InvalidRequestError

_REPLACEMENT = "\ufffd"


def chat_prompt_ids(checkpoint_dir: str | os.PathLike, user_text: str, system: str | None = None) -> list[int]:
    """Prompt token ids of one user turn (plus an optional system turn) under the checkpoint's chat template,
    ending with the assistant's generation prompt.

    A template that expects typed content (``[{"type": "text", "text": ...}]``, as multimodal processors' templates
    do) gets that form when plain string content fails to render.

    Raises:
        InvalidRequestError: the checkpoint has no chat template, or the template cannot render the message.
    """
    from transformers import AutoTokenizer

    path = Path(checkpoint_dir)
    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:  # no tokenizer files, unreadable config
        raise InvalidRequestError(f"--chat: cannot load the tokenizer of {path}: {exc}") from None
    if not getattr(tok, "chat_template", None):
        raise InvalidRequestError(f"--chat: the checkpoint {path} has no chat template; drop --chat to send the "
                                  f"prompt text as it is")

    def messages(typed: bool) -> list[dict]:
        def content(text: str):
            return [{"type": "text", "text": text}] if typed else text

        out = [{"role": "system", "content": content(system)}] if system is not None else []
        return out + [{"role": "user", "content": content(user_text)}]

    errors = []
    for typed in (False, True):
        try:
            enc = tok.apply_chat_template(messages(typed), add_generation_prompt=True, tokenize=True,
                                          return_dict=True)
        except Exception as exc:  # jinja2 errors, template exceptions
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        return [int(i) for i in enc["input_ids"]]
    raise InvalidRequestError(f"--chat: the chat template of {path} cannot render the prompt ({errors[-1]})")


class IncrementalDetokenizer:
    """Text deltas for a growing sequence of token ids, never ending in a partial character.

    Args:
        tokenizer: a ``tokenizers.Tokenizer`` (or None with ``decode``).
        skip_special_tokens: leave out special tokens (``<|im_end|>``, ...) as Hugging Face's streamers do.
        decode: ``ids -> text`` used instead of ``tokenizer`` (a transformers tokenizer's ``decode``, say).

    ``push(ids)`` returns the text the new ids complete (possibly ``""`` while a character is incomplete);
    ``flush()`` returns what is left at the end (a trailing U+FFFD if the sequence ended mid-character). The
    concatenation of every delta equals ``tokenizer.decode(all ids)``. Each push decodes only a short window (the
    ids since the last emitted text and the few before them, for context), so a stream of ``n`` tokens costs
    O(n), not the O(n^2) of decoding everything every step (the windowed detokenization of Hugging Face's
    ``TextStreamer`` and vLLM's incremental detokenizer).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 decode: Callable[[list[int]], str] | None = None):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_fn = decode
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True) if decode is None else None
        self.ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded for context
        self._read = 0  # ids before this index have been emitted as text

    def _decode(self, ids: Sequence[int]) -> str:
        if self._decode_fn is not None:
            return self._decode_fn(list(ids))
        return self.tokenizer.decode([i for i in ids if 0 <= i < self.vocab_size],
                                     skip_special_tokens=self.skip_special_tokens)

    def push(self, ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in ids)
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        if len(text) > len(before) and not text.endswith(_REPLACEMENT):
            self._prefix, self._read = self._read, len(self.ids)
            return text[len(before):]
        return ""

    def flush(self) -> str:
        before = self._decode(self.ids[self._prefix:self._read])
        text = self._decode(self.ids[self._prefix:])
        self._prefix = self._read = len(self.ids)
        return text[len(before):]
