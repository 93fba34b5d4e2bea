"""Whisper decoder runtime (Radford et al. 2022) with a static per-slot KV cache, tree attention and
cross-attention to a per-slot encoder output.

Duck-typed like :class:`~specstream.stages.speculative.models.llama.LlamaDecoder` (``forward_batch``,
``new_cache``, ``embed``, ``config.vocab_size``, ``config.max_position_embeddings``, ``dtype``, ``device``), so the
speculative executor verifies Whisper token trees exactly as it verifies Llama ones. The module tree mirrors
Hugging Face's ``WhisperForConditionalGeneration`` (``model.decoder.layers.N.self_attn.q_proj`` ...), so its
checkpoints load by name; ``proj_out`` is tied to ``model.decoder.embed_tokens``.

The decoder differs from Llama in four ways: learned absolute positions (no RoPE), pre-LayerNorm blocks with
biases (the self-attention key projection has none), GELU MLPs, and a cross-attention block per layer that
attends to the encoder output. The cross-attention keys/values depend on the audio only, so they are computed
once per request (:meth:`WhisperDecoder.set_encoder_output`) into per-slot storage of the :class:`WhisperKVCache`.
The encoder itself runs as Hugging Face's ``WhisperEncoder`` module (:func:`load_whisper_encoder`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from specstream.errors import UnsupportedArchitectureError
from specstream.kernels.tree_attention import attention_bias, tree_attention
from specstream.stages.speculative.models.kv_cache import KVCache
from specstream.stages.speculative.models.llama import ForwardBatch

if TYPE_CHECKING:
    from specstream.kernels.quant import WeightFormat


@dataclass(frozen=True)
class WhisperDecoderConfig:
    """The fields of a Whisper ``config.json`` the decoder runtime needs (see :func:`whisper_config_from_dict`).

    ``max_position_embeddings`` is Whisper's ``max_target_positions`` (448 tokens for the released models);
    ``max_source_positions`` is the encoder output length (1500 frames = 30 s).
    """

    vocab_size: int
    d_model: int
    decoder_layers: int
    decoder_attention_heads: int
    decoder_ffn_dim: int
    max_position_embeddings: int
    max_source_positions: int
    num_mel_bins: int
    activation_function: str = "gelu"
    eos_token_ids: tuple[int, ...] = ()
    decoder_start_token_id: int | None = None
    model_type: str = "whisper"
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.decoder_attention_heads

    # Llama-style aliases read by generic code (the executor, the KV cache budget)
    @property
    def num_hidden_layers(self) -> int:
        return self.decoder_layers

    @property
    def hidden_size(self) -> int:
        return self.d_model


def whisper_config_from_dict(cfg: dict[str, Any]) -> WhisperDecoderConfig:
    """Build a :class:`WhisperDecoderConfig` from a parsed Hugging Face Whisper ``config.json``.

    Raises:
        UnsupportedArchitectureError: not a Whisper config, or an activation the runtime lacks.
    """
    if cfg.get("model_type") != "whisper":
        raise UnsupportedArchitectureError(f"not a Whisper config: model_type={cfg.get('model_type')!r}")
    act = cfg.get("activation_function", "gelu")
    if act not in _ACTIVATIONS:
        raise UnsupportedArchitectureError(f"Whisper activation {act!r} is not supported ({sorted(_ACTIVATIONS)})")
    d_model = int(cfg["d_model"])
    heads = int(cfg["decoder_attention_heads"])
    if d_model % heads:
        raise UnsupportedArchitectureError(f"d_model {d_model} is not a multiple of {heads} heads")
    eos = cfg.get("eos_token_id")
    eos_ids = () if eos is None else ((int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos))
    return WhisperDecoderConfig(
        vocab_size=int(cfg["vocab_size"]),
        d_model=d_model,
        decoder_layers=int(cfg["decoder_layers"]),
        decoder_attention_heads=heads,
        decoder_ffn_dim=int(cfg["decoder_ffn_dim"]),
        max_position_embeddings=int(cfg.get("max_target_positions", 448)),
        max_source_positions=int(cfg.get("max_source_positions", 1500)),
        num_mel_bins=int(cfg.get("num_mel_bins", 80)),
        activation_function=act,
        eos_token_ids=eos_ids,
        decoder_start_token_id=cfg.get("decoder_start_token_id"),
        raw=dict(cfg),
    )


_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


class WhisperKVCache(KVCache):
    """A :class:`KVCache` for the decoder's self-attention plus per-slot cross-attention keys/values.

    Extra layout: ``cross_k`` / ``cross_v`` ``[num_layers, num_slots, num_heads, max_source_len, head_dim]``
    (the encoder output projected by each layer's ``encoder_attn.k_proj`` / ``v_proj``), ``enc_lengths[s]`` the
    number of valid encoder frames of slot ``s`` (0 until :meth:`WhisperDecoder.set_encoder_output`).
    ``reset(slot)`` forgets the self-attention entries; the cross entries stay until the next request of the
    slot overwrites them.
    """

    def __init__(self, num_layers: int, num_slots: int, num_heads: int, max_len: int, head_dim: int,
                 max_source_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(num_layers, num_slots, num_heads, max_len, head_dim, dtype, device)
        shape = (num_layers, num_slots, num_heads, max_source_len, head_dim)
        self.cross_k = torch.zeros(shape, dtype=dtype, device=device)
        self.cross_v = torch.zeros(shape, dtype=dtype, device=device)
        self.enc_lengths = [0] * num_slots
        self.max_source_len = max_source_len

    def nbytes(self) -> int:
        return super().nbytes() + self.cross_k.numel() * self.cross_k.element_size() * 2

    def reset(self, slot: int) -> None:
        """Forget a slot's contents, its encoder output included."""
        super().reset(slot)
        self.enc_lengths[slot] = 0

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """:meth:`KVCache.copy_prefix`, and the slot's cross-attention keys/values with it."""
        super().copy_prefix(src, dst, length)
        n = self.enc_lengths[src]
        self.cross_k[:, dst, :, :n] = self.cross_k[:, src, :, :n]
        self.cross_v[:, dst, :, :n] = self.cross_v[:, src, :, :n]
        self.enc_lengths[dst] = n


class _WhisperAttention(nn.Module):
    """Whisper's attention projections (HF names; the key has no bias) and the head split."""

    def __init__(self, cfg: WhisperDecoderConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.decoder_attention_heads
        self.head_dim = cfg.head_dim
        d = cfg.d_model
        self.q_proj = nn.Linear(d, d, bias=True)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=True)
        self.out_proj = nn.Linear(d, d, bias=True)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        bsz, t, _ = x.shape
        return x.reshape(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)


class WhisperSelfAttention(_WhisperAttention):
    """Masked self-attention over the slot's cache columns (tree masks come from the caller).

    ``qkv_proj``: the three projections as one quantized layer (:meth:`WhisperDecoder.fuse_projections`), or
    None (then ``q_proj``, ``k_proj``, ``v_proj``)."""

    def __init__(self, cfg: WhisperDecoderConfig, layer: int):
        super().__init__(cfg, layer)
        self.register_module("qkv_proj", None)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries, keys and values ``[B, H, T, head_dim]`` of ``x`` ``[B, T, d_model]``."""
        if self.qkv_proj is not None:
            return tuple(self._heads(p) for p in self.qkv_proj(x).chunk(3, -1))
        return self._heads(self.q_proj(x)), self._heads(self.k_proj(x)), self._heads(self.v_proj(x))

    def forward(self, x, cache: WhisperKVCache, batch: ForwardBatch, key_len: int, mask: torch.Tensor):
        bsz, t, _ = x.shape
        q, k, v = self.qkv(x)
        cache.write(self.layer, batch.slots, batch.write_index, k, v)
        keys, values = cache.read(self.layer, batch.read_slots, key_len)
        want = self.layer in batch.attention_layers
        out, probs = tree_attention(q, keys, values, batch.attn_bias, self.head_dim**-0.5, return_probs=want)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, t, -1)), probs


@dataclass(frozen=True)
class CrossKV:
    """One encoder output projected by every decoder layer's cross-attention (:meth:`WhisperDecoder.project`).

    ``set_encoder_output`` copies it into a slot instead of projecting again, so an encoder output that several
    decoder passes use (the request and Whisper's no-speech probe) is projected once.

    Attributes:
        k, v: ``[num_layers, num_heads, S_enc, head_dim]``.
    """

    k: torch.Tensor
    v: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.k.shape[2])


class WhisperCrossAttention(_WhisperAttention):
    """Attention of decoder tokens to the slot's encoder output (keys/values precomputed per slot)."""

    def project(self, encoder_hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, num_heads, S_enc, head_dim]`` of ``encoder_hidden`` ``[B, S_enc, d_model]``."""
        b, s, _ = encoder_hidden.shape
        k = self.k_proj(encoder_hidden).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(encoder_hidden).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        return k, v

    def forward(self, x, cache: WhisperKVCache, batch: ForwardBatch, enc_len: int, enc_mask: torch.Tensor | None):
        bsz, t, _ = x.shape
        q = self.q_proj(x).view(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)
        keys = cache.cross_k[self.layer][batch.read_slots, :, :enc_len]
        values = cache.cross_v[self.layer][batch.read_slots, :, :enc_len]
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=enc_mask, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(bsz, t, -1))


class WhisperDecoderLayer(nn.Module):
    def __init__(self, cfg: WhisperDecoderConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.self_attn = WhisperSelfAttention(cfg, layer)
        self.self_attn_layer_norm = nn.LayerNorm(d)
        self.encoder_attn = WhisperCrossAttention(cfg, layer)
        self.encoder_attn_layer_norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d)
        self.act = _ACTIVATIONS[cfg.activation_function]

    def forward(self, x, cache, batch, key_len, mask, enc_len, enc_mask):
        attn, probs = self.self_attn(self.self_attn_layer_norm(x), cache, batch, key_len, mask)
        x = x + attn
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), cache, batch, enc_len, enc_mask)
        x = x + self.fc2(self.act(self.fc1(self.final_layer_norm(x))))
        return x, probs


class _DecoderStack(nn.Module):
    def __init__(self, cfg: WhisperDecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.embed_positions = nn.Embedding(cfg.max_position_embeddings, cfg.d_model)
        self.layers = nn.ModuleList(WhisperDecoderLayer(cfg, i) for i in range(cfg.decoder_layers))
        self.layer_norm = nn.LayerNorm(cfg.d_model)


class _WhisperModel(nn.Module):
    def __init__(self, cfg: WhisperDecoderConfig):
        super().__init__()
        self.decoder = _DecoderStack(cfg)


class WhisperDecoder(nn.Module):
    """Whisper's text decoder reading and writing a :class:`WhisperKVCache`.

    Build with :func:`load_whisper_decoder` (or ``loader.load_decoder`` on a Whisper checkpoint); per request,
    call :meth:`set_encoder_output` once, then :meth:`forward_batch` for the prompt and every token tree.
    """

    #: the engine refuses requests without an encoder output (see ``SpeculativeEngine.add_request``)
    requires_encoder_output = True

    def __init__(self, cfg: WhisperDecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = _WhisperModel(cfg)
        self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def tie_weights(self) -> None:
        self.proj_out.weight = self.model.decoder.embed_tokens.weight

    def fuse_projections(self) -> int:
        """Replace each layer's quantized self-attention ``q``/``k``/``v`` projections by one ``qkv_proj``
        (:func:`specstream.kernels.quant.fuse_linears`: bit-identical outputs, one kernel call instead of three:
        at tiny.en's width a quantized product's call costs several times its 384 x 384 weight read; the key
        projection has no bias, and ``fuse_linears`` gives it zeros). Returns the layers fused."""
        from specstream.kernels.quant import fuse_linears

        count = 0
        for layer in self.model.decoder.layers:
            sa = layer.self_attn
            if sa.qkv_proj is not None:
                continue
            fused = fuse_linears([sa.q_proj, sa.k_proj, sa.v_proj])  # None for float layers
            if fused is None:
                continue
            sa.qkv_proj = fused
            del sa.q_proj, sa.k_proj, sa.v_proj
            count += 1
        return count

    @property
    def dtype(self) -> torch.dtype:
        return self.model.decoder.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.decoder.embed_tokens.weight.device

    def new_cache(self, num_slots: int, max_len: int) -> WhisperKVCache:
        cfg = self.config
        return WhisperKVCache(cfg.decoder_layers, num_slots, cfg.decoder_attention_heads, max_len, cfg.head_dim,
                              cfg.max_source_positions, self.dtype, self.device)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, T, d_model]`` for ``input_ids`` ``[B, T]`` (positions are added in the forward)."""
        return self.model.decoder.embed_tokens(input_ids)

    @torch.inference_mode()
    def project(self, encoder_hidden: torch.Tensor) -> list[CrossKV]:
        """Cross-attention keys/values of a batch of encoder outputs ``[B, S_enc, d_model]`` (one batched
        projection per layer).

        Raises:
            ValueError: wrong shape.
        """
        if encoder_hidden.ndim == 2:
            encoder_hidden = encoder_hidden[None]
        if encoder_hidden.ndim != 3 or encoder_hidden.shape[2] != self.config.d_model:
            raise ValueError(f"encoder outputs must be [B, S_enc, {self.config.d_model}], "
                             f"got {tuple(encoder_hidden.shape)}")
        enc = encoder_hidden.to(device=self.device, dtype=self.dtype)
        kvs = [layer.encoder_attn.project(enc) for layer in self.model.decoder.layers]  # per layer [B, H, S, Dh]
        k, v = torch.stack([x[0] for x in kvs], 1), torch.stack([x[1] for x in kvs], 1)  # [B, L, H, S, Dh]
        return [CrossKV(k[i], v[i]) for i in range(k.shape[0])]

    @torch.inference_mode()
    def set_encoder_output(self, cache: WhisperKVCache, slot: int, encoder_hidden: torch.Tensor | CrossKV) -> None:
        """Project one request's encoder output into ``slot``'s cross-attention keys/values.

        Args:
            cache: this decoder's cache.
            slot: the request's KV cache slot.
            encoder_hidden: ``[S_enc, d_model]`` (or ``[1, S_enc, d_model]``), ``S_enc <= max_source_positions``;
                or its :class:`CrossKV` from :meth:`project` (copied, not projected again).

        Raises:
            ValueError: wrong shape or too long.
        """
        if not isinstance(encoder_hidden, CrossKV):
            if encoder_hidden.ndim != 2 and not (encoder_hidden.ndim == 3 and encoder_hidden.shape[0] == 1):
                raise ValueError(f"encoder output must be [S_enc, {self.config.d_model}], "
                                 f"got {tuple(encoder_hidden.shape)}")
            encoder_hidden = self.project(encoder_hidden)[0]
        s = encoder_hidden.length
        if not 0 < s <= cache.max_source_len:
            raise ValueError(f"encoder output of {s} frames does not fit the cache ({cache.max_source_len})")
        cache.cross_k[:, slot, :, :s] = encoder_hidden.k
        cache.cross_v[:, slot, :, :s] = encoder_hidden.v
        cache.enc_lengths[slot] = s

    def saved_encoder_output(self, cache: WhisperKVCache, slot: int) -> CrossKV | None:
        """A copy of ``slot``'s cross-attention keys/values (None when it holds no encoder output): what a
        preempted request needs to be prefilled again after its slot was freed."""
        s = cache.enc_lengths[slot]
        if not s:
            return None
        return CrossKV(cache.cross_k[:, slot, :, :s].clone(), cache.cross_v[:, slot, :, :s].clone())

    @torch.inference_mode()
    def cross_attention_scores(self, encoder: CrossKV, input_ids: list[int], heads: list[tuple[int, int]]
                               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Teacher-forced forward of one token sequence, returning the pre-softmax cross-attention scores of the
        given ``(layer, head)`` pairs (word alignment, as openai-whisper's ``find_alignment`` reads them).

        Args:
            encoder: one window's cross-attention keys/values (:meth:`project`).
            input_ids: ``T <= max_position_embeddings`` tokens.
            heads: alignment heads.

        Returns:
            ``(logits [T, vocab] float32, scores [len(heads), T, S_enc] float32)`` where
            ``scores = q k^T / sqrt(head_dim)`` of each head (the softmax of which is the attention).

        Raises:
            ValueError: a sequence longer than the position table, a head outside the model.
        """
        n, cfg = len(input_ids), self.config
        if not 0 < n <= cfg.max_position_embeddings:
            raise ValueError(f"{n} tokens do not fit the decoder's {cfg.max_position_embeddings} positions")
        if any(not (0 <= l < cfg.decoder_layers and 0 <= h < cfg.decoder_attention_heads) for l, h in heads):
            raise ValueError(f"alignment heads {heads} outside {cfg.decoder_layers} layers x "
                             f"{cfg.decoder_attention_heads} heads")
        dev = self.device
        dec = self.model.decoder
        ids = torch.tensor([input_ids], device=dev)
        x = self.embed(ids).to(self.dtype) + dec.embed_positions(torch.arange(n, device=dev))[None]
        wanted: dict[int, list[int]] = {}
        for l, h in heads:
            wanted.setdefault(l, []).append(h)
        found: dict[tuple[int, int], torch.Tensor] = {}
        cross_k = encoder.k.to(device=dev, dtype=self.dtype)[:, None]  # [L, 1, H, S, Dh]
        cross_v = encoder.v.to(device=dev, dtype=self.dtype)[:, None]
        for i, layer in enumerate(dec.layers):
            sa = layer.self_attn
            h = layer.self_attn_layer_norm(x)
            out = F.scaled_dot_product_attention(*sa.qkv(h), is_causal=True, scale=sa.head_dim**-0.5)
            x = x + sa.out_proj(out.transpose(1, 2).reshape(1, n, -1))
            ca = layer.encoder_attn
            q = ca._heads(ca.q_proj(layer.encoder_attn_layer_norm(x)))
            scores = (q @ cross_k[i].transpose(-1, -2)) * ca.head_dim**-0.5  # [1, H, T, S]
            for hd in wanted.get(i, []):
                found[(i, hd)] = scores[0, hd].float()
            out = scores.softmax(-1) @ cross_v[i]
            x = x + ca.out_proj(out.transpose(1, 2).reshape(1, n, -1))
            x = x + layer.fc2(layer.act(layer.fc1(layer.final_layer_norm(x))))
        logits = self.proj_out(dec.layer_norm(x)).float()[0]
        return logits, torch.stack([found[lh] for lh in heads])

    def _encoder_mask(self, cache: WhisperKVCache, slots: list[int]) -> tuple[int, torch.Tensor | None]:
        lengths = [cache.enc_lengths[s] for s in slots]
        if min(lengths) == 0:
            raise ValueError("forward on a slot without encoder output: call set_encoder_output first")
        enc_len = max(lengths)
        if min(lengths) == enc_len:
            return enc_len, None
        cols = torch.arange(enc_len, device=self.device)
        mask = cols[None, :] < torch.tensor(lengths, device=self.device)[:, None]  # [B, S_enc]
        return enc_len, mask[:, None, None, :]

    @torch.inference_mode()
    def forward_batch(self, cache: WhisperKVCache, batch: ForwardBatch) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the decoder over ``batch``, writing its self-attention keys/values into ``cache``.

        Position ids index the learned position table (``< max_position_embeddings``).

        Returns:
            ``(logits [B, R, vocab] float32, {layer: self-attention probs [B, H, T, S]})``.

        Raises:
            ValueError: bad shapes, positions out of range, a slot without encoder output.
        """
        if batch.input_ids.ndim != 2 or batch.attn_mask.ndim != 3:
            raise ValueError("input_ids must be [B, T] and attn_mask [B, T, S]")
        top = batch.max_position if batch.max_position is not None else int(batch.position_ids.max())
        if top >= self.config.max_position_embeddings:
            raise ValueError(f"position {top} beyond the decoder's {self.config.max_position_embeddings} positions")
        dec = self.model.decoder
        x = batch.inputs_embeds if batch.inputs_embeds is not None else self.embed(batch.input_ids)
        x = x.to(self.dtype) + dec.embed_positions(batch.position_ids)
        key_len = batch.attn_mask.shape[-1]
        cache.positions[batch.slots[:, None], batch.write_index] = batch.position_ids
        batch.resolve_reads()
        batch.attn_bias = attention_bias(batch.attn_mask, x.dtype)
        enc_len, enc_mask = self._encoder_mask(
            cache, batch.slot_list if batch.slot_list is not None else batch.slots.tolist())
        probs: dict[int, torch.Tensor] = {}
        for layer in dec.layers:
            x, p = layer(x, cache, batch, key_len, batch.attn_mask, enc_len, enc_mask)
            if p is not None:
                probs[layer.self_attn.layer] = p
        if batch.logit_index is not None:
            x = torch.gather(x, 1, batch.logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        x = dec.layer_norm(x)
        return self.proj_out(x).float(), probs


def _decoder_key(key: str) -> str | None:
    # proj_out.weight is tied to the token embeddings; model.encoder.* is loaded by load_whisper_encoder
    return key if key.startswith("model.decoder.") else None


def _weight_precision(module: nn.Module, dtype: str | torch.dtype, device: str,
                      skip: tuple[str, ...] = ()) -> WeightFormat | None:
    """Cast ``module`` (a Whisper encoder or decoder) to the weight precision ``dtype``, in place: a float dtype
    (float32, bfloat16, float16) casts every tensor; int8 / int4 (:func:`dtypes.weight_format`) quantize every
    ``nn.Linear`` through :func:`specstream.kernels.quant.quantize_linears` (weight-only, per output channel for
    int8, in groups for int4) and run the rest (embeddings, layer norms, convolutions, attention) and the
    activations in bfloat16 where the device has bfloat16 arithmetic (:func:`~specstream.kernels.quant.native_bf16`),
    in float32 elsewhere: on an AVX2-only CPU, PyTorch's bfloat16 attention converts in software, and tiny.en's
    cross-attention over 1,500 frames took 1.25 ms a layer in bfloat16 against 0.17 ms in float32 (a probe on the
    AMD EPYC Zen 3 of ``docs/benchmarks.md``, read bandwidth not measured in it), so int4 weights
    with bfloat16 activations decoded no faster than float32 and encoded at half its speed
    (``docs/benchmarks.md``). The quantized layers take and give float32 there, rounding the activations to
    bfloat16 only inside the product. ``skip``: names of linear layers left unquantized (the caller's).

    Returns:
        The :class:`~specstream.kernels.quant.WeightFormat` of a quantized precision, None for a float one.

    Raises:
        UnsupportedDtypeError: a precision ``device`` cannot run; QuantKernelError: a packed kernel disagrees with
            its float reference.
    """
    from specstream.stages.speculative.models.dtypes import AUTO, auto_weight_dtype, parse_dtype, weight_format

    if dtype == AUTO:
        dtype = auto_weight_dtype(device)
    if dtype in ("int8", "int4") or (isinstance(dtype, str) and dtype.startswith("int4-")):
        from specstream.kernels.quant import native_bf16, quantize_linears

        fmt = weight_format(dtype, device)
        if native_bf16(device):
            module.to(torch.bfloat16)
        quantize_linears(module, fmt, skip)
        return fmt
    module.to(parse_dtype(dtype))
    return None


def quantized_output_projection(weight: torch.Tensor, fmt: WeightFormat) -> nn.Module:
    """The output projection (tied to the token embeddings, ``weight`` ``[vocab, d_model]`` float) at ``fmt``:
    int8 per output channel; at int4, int4 plus an int4 code of its rounding error
    (:class:`~specstream.kernels.quant.Int4ResidualLinear`, about 8 bits per weight; its cost is measured there),
    as llama.cpp's Q4_K_M keeps its output tensor at 6 bits. The logits decide every token: a plain int4
    projection raised tiny.en's word error rate on the espeak-ng script from 0.095 (float32) to 0.155, and base's
    from 0.119 to 0.167, where the rest of the model at int4 with this projection gives 0.083 and 0.119
    (``docs/models.md``). A projection whose columns are not a multiple of the group (no Whisper model) is int8,
    as :func:`~specstream.kernels.quant.quantize_weight` gives.

    Raises:
        QuantKernelError: the packed kernel disagrees with its float reference.
    """
    from specstream.kernels.quant import Int4ResidualLinear, int4_packable, quantize_weight

    if fmt.name == "int4" and int4_packable(*weight.shape, fmt.group_size):
        return Int4ResidualLinear.from_float(weight, None, fmt.group_size)
    return quantize_weight(weight, None, fmt)


def load_whisper_decoder(checkpoint, dtype: str | torch.dtype = "float32", device: str = "cpu") -> WhisperDecoder:
    """Build a :class:`WhisperDecoder` from a Hugging Face Whisper checkpoint (dir, hub id or ``Checkpoint``).

    Every decoder tensor must be present (strict); the output projection is tied to the token embeddings (at int8
    / int4 the projection is a quantized copy, :func:`quantized_output_projection`; the embedding table stays in
    the activation dtype). ``dtype``:
    float32, bfloat16, float16, int8, int4 (:func:`_weight_precision`); the KV cache and activations follow the
    embedding's dtype. At int8 / int4 the self-attention projections are fused
    (:meth:`WhisperDecoder.fuse_projections`).

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, UnsupportedDtypeError.
    """
    from specstream.stages.speculative.models.checkpoint import Checkpoint, load_state_dict, resolve_checkpoint

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint)
    cfg = whisper_config_from_dict(ckpt.config)
    if ckpt.config.get("tie_word_embeddings") is False:
        raise UnsupportedArchitectureError(f"{ckpt.path}: Whisper with untied output embeddings is not supported")
    state = load_state_dict(ckpt.weight_files(), _decoder_key, device)
    with torch.device("meta"):
        model = WhisperDecoder(cfg)
    model.to_empty(device=device)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if m != "proj_out.weight"]
    if missing or unexpected:
        raise UnsupportedArchitectureError(
            f"{ckpt.path}: weights do not match a Whisper decoder (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.tie_weights()
    head = model.proj_out.weight.detach()  # float32 from the checkpoint, before any cast
    fmt = _weight_precision(model, dtype, device, skip=("proj_out",))
    if fmt is not None:
        model.proj_out = quantized_output_projection(head, fmt)
    model.fuse_projections()
    model.eval()
    from specstream.kernels.linear import pack_linears

    # CPU: oneDNN pre-packed weights, as for the Llama decoders. PyTorch's default float32 path repacks a weight on
    # every call, which made the 51864-wide output projection of tiny.en cost 21 ms for a 5-node tree against
    # 11 ms for one row (one thread): tree verification cost what the accepted drafts saved. Packed: 5.8 ms and
    # 6.9 ms. (The packed output projection is a copy: the token embeddings keep their own table.)
    pack_linears(model)
    return model


def load_whisper_encoder(checkpoint, dtype: str | torch.dtype = "float32", device: str = "cpu"):
    """Hugging Face's ``WhisperEncoder`` with the checkpoint's ``model.encoder.*`` weights (strict).

    Input: log-mel features ``[B, num_mel_bins, 2 * max_source_positions]``; output ``last_hidden_state``
    ``[B, max_source_positions, d_model]`` (bfloat16 at int8 / int4 where the device has bfloat16 arithmetic:
    :func:`_weight_precision`).

    Raises:
        CheckpointNotFoundError, UnsupportedArchitectureError, UnsupportedDtypeError.
    """
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    from specstream.stages.speculative.models.checkpoint import Checkpoint, load_state_dict, resolve_checkpoint

    ckpt = checkpoint if isinstance(checkpoint, Checkpoint) else resolve_checkpoint(checkpoint)
    whisper_config_from_dict(ckpt.config)  # validates the architecture
    hf_cfg = WhisperConfig(**{k: v for k, v in ckpt.config.items() if k not in ("architectures", "transformers_version")})
    prefix = "model.encoder."
    state = load_state_dict(ckpt.weight_files(), lambda k: k[len(prefix):] if k.startswith(prefix) else None, device)
    with torch.device("meta"):
        encoder = WhisperEncoder(hf_cfg)
    encoder.to_empty(device=device)
    missing, unexpected = encoder.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UnsupportedArchitectureError(
            f"{ckpt.path}: weights do not match a Whisper encoder (missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    _weight_precision(encoder, dtype, device)
    encoder.eval()
    return encoder
