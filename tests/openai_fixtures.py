"""Shared by the OpenAI-route test modules: the API key their servers accept, the official client against a
:class:`live_fixtures.ServerThread`, and the Hugging Face reference of the built-in tiny LLaVA target."""

from __future__ import annotations

KEY = "sk-test-key"


def openai_client(server):
    import openai

    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)


def tiny_llava_hf():
    """``(model, processor)``: the built-in tiny LLaVA target in float32, loaded by transformers."""
    import torch
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    from specstream.pipeline.defaults import default_caption_models

    target, _ = default_caption_models(quiet=True)
    return (LlavaForConditionalGeneration.from_pretrained(target, dtype=torch.float32).eval(),
            AutoProcessor.from_pretrained(target))
