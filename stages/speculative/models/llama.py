"""Llama-family decoder runtime (Llama, Mistral, Qwen2) with a static per-slot KV cache and tree attention.

The module tree mirrors Hugging Face's ``LlamaForCausalLM`` (``model.embed_tokens``, ``model.layers.N.self_attn.
q_proj`` ...) so checkpoints load by name. Unlike HF, the forward takes explicit position ids, explicit KV cache
columns and an explicit boolean attention mask: that is what token-tree verification needs (SpecInfer §4.2).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from specstream.kernels.row_attention import available as row_attention_available
from specstream.kernels.row_attention import row_attention
from specstream.kernels.row_attention import unavailable_reason as row_attention_reason

from specstream.kernels.tree_attention import (
    CanonicalPlan,
    attention_bias,
    canonical_attention,
    canonical_plan,
    tree_attention,
)
from specstream.stages.speculative.models.config import DecoderConfig
from specstream.stages.speculative.models.kv_cache import KVCache

log = logging.getLogger("specstream.models")


@dataclass
class ForwardBatch:
    """One decoder forward over a ragged batch (rows padded to ``T``).

    Attributes:
        slots: ``[B]`` KV cache slot of each row.
        input_ids: ``[B, T]`` token ids (ignored where ``inputs_embeds`` is given).
        position_ids: ``[B, T]`` RoPE positions (prefix length + depth in the tree).
        write_index: ``[B, T]`` cache column receiving each token's key/value (scratch column for padding).
        attn_mask: ``[B, T, S]`` bool over cache columns ``[0, S)``.
        logit_index: ``[B, R]`` rows whose logits are returned (None: all ``T``).
        inputs_embeds: ``[B, T, hidden]`` optional embeddings (visual tokens spliced in by a VLM).
        attention_layers: layer indices whose attention probabilities are returned (``[B, Hq, T, S]`` each).
        slot_list: the slots as a host list (lets the decoder slice the cache instead of gathering, without a
            device sync); None: read from ``slots``.
        max_position: the largest position id, known on the host (checked without a device sync).
    """

    slots: torch.Tensor
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    write_index: torch.Tensor
    attn_mask: torch.Tensor
    logit_index: torch.Tensor | None = None
    inputs_embeds: torch.Tensor | None = None
    attention_layers: tuple[int, ...] = ()
    slot_list: list[int] | None = None
    max_position: int | None = None  # host-known largest position id (lets a decoder check it without a sync)
    read_slots: torch.Tensor | slice | None = None  # set by the decoder: a slice of slots (view) or an index tensor
    attn_bias: torch.Tensor | None = None  # set by the decoder: additive [B, 1, T, S] bias shared by every layer
    attn_bias_f32: torch.Tensor | None = None  # set by the decoder for bf16 activations: the bias in float32
    #: the row-invariant attention for bf16 activations (:func:`canonical_attention`): a row's bits do not depend
    #: on the rows beside it. Set by the executor for the target's forwards, whose greedy output must equal plain
    #: decoding; drafts and other forwards keep SDPA (faster, and their bits decide no output token).
    row_invariant: bool = False
    #: host list of the rows holding token trees (their nodes sit at node columns, not in position order) and how
    #: many query rows of theirs hold nodes; set by the executor, read by the canonical attention's plan
    tree_rows: list[int] | None = None
    tree_width: int = 0
    canonical: CanonicalPlan | None = None  # set by the decoder when ``row_invariant`` applies
    #: ``[B, S]`` position held by each cache column read, set by the decoder when ``row_invariant`` applies on
    #: a CPU with the C++ row-invariant attention (:mod:`specstream.kernels.row_attention`; then no plan)
    row_key_pos: torch.Tensor | None = None
    #: host list of each row's real tokens (the first ``n`` of its ``T``; the rest is padding), or None. Where
    #: padding is there, the decoder runs its projections, MLPs and output head on the real tokens only
    #: (packed ``[N, hidden]``) and pads them for the attention alone: a batch of token trees of different
    #: sizes then costs its nodes, not ``B x T`` (the packed, "ragged" batches of vLLM and SGLang).
    row_lengths: list[int] | None = None
    pack: torch.Tensor | None = None  # set by the decoder: ``[N]`` flat indices ``b * T + t`` of the real tokens
    logit_index_host: list[list[int]] | None = None  # ``logit_index`` as a host list (packing reads it, no sync)

    def resolve_reads(self) -> None:
        """Decide once per forward, on the host, how layers read the cache: a slice when the slots are a
        contiguous increasing range, else a gather."""
        slots = self.slot_list if self.slot_list is not None else self.slots.tolist()
        first = slots[0]
        if slots == list(range(first, first + len(slots))):
            self.read_slots = slice(first, first + len(slots))
        else:
            self.read_slots = self.slots


#: ``SPECSTREAM_ROW_INVARIANT_ATTENTION=0`` (read once, at import) gives the target SDPA as well, for A/B runs;
#: greedy speculative output at bf16 activations is then no longer guaranteed to equal plain decoding
ROW_INVARIANT_ATTENTION = os.environ.get("SPECSTREAM_ROW_INVARIANT_ATTENTION", "1") != "0"


@lru_cache(maxsize=1)
def _row_kernel() -> bool:
    """Whether the target's CPU forwards use the C++ row-invariant attention, decided once per process (its bits
    differ from the PyTorch formulation's, so one process keeps one; the first call may compile it, about 25 s).

    Raises:
        RowAttentionUnavailable: ``SPECSTREAM_ROW_ATTENTION=cpp`` and it cannot run here.
    """
    ok = row_attention_available()
    if not ok:
        log.info("row-invariant attention in PyTorch ops: %s", row_attention_reason())
    return ok


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32 as HF Llama does."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def _unpack(y: torch.Tensor, batch: ForwardBatch | None, bsz: int, t: int) -> torch.Tensor:
    """A projection of the packed real tokens ``[N, F]`` padded back to ``[B, T, F]`` (zeros at padding; their
    keys/values go to the scratch column, their outputs are dropped); ``y`` as it is without packing."""
    if batch is None or batch.pack is None:
        return y
    full = y.new_zeros((bsz * t, y.shape[-1]))
    full.index_copy_(0, batch.pack, y)
    return full.view(bsz, t, -1)


def _pack(y: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
    """``[B, T, F]`` -> the real tokens ``[N, F]`` when ``batch.pack`` is set; ``y`` as it is otherwise."""
    if batch.pack is None:
        return y
    return y.reshape(-1, y.shape[-1]).index_select(0, batch.pack)


class Attention(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        # ``[q; k; v]`` in one quantized product, set by :meth:`LlamaDecoder.fuse_projections` (then the three
        # separate projections are gone)
        self.register_module("qkv_proj", None)
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def _qkv(self, x, cos, sin, batch: ForwardBatch | None = None):
        bsz, t = cos.shape[0], cos.shape[-2]
        if self.qkv_proj is not None:
            h, hkv = self.num_heads, self.num_kv_heads
            qkv = _unpack(self.qkv_proj(x), batch, bsz, t).view(bsz, t, h + 2 * hkv, self.head_dim).transpose(1, 2)
            qk = qkv[:, : h + hkv]
            qk = qk * cos + rotate_half(qk) * sin  # RoPE on the query and key heads at once (elementwise)
            return qk[:, :h], qk[:, h:], qkv[:, h + hkv:]
        q = _unpack(self.q_proj(x), batch, bsz, t).view(bsz, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = _unpack(self.k_proj(x), batch, bsz, t).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = _unpack(self.v_proj(x), batch, bsz, t).view(bsz, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def forward(self, x, cos, sin, cache: KVCache, batch: ForwardBatch, key_len: int, mask: torch.Tensor):
        """``x``: ``[B, T, hidden]``, or the real tokens ``[N, hidden]`` when ``batch.pack`` is set (the result
        has ``x``'s layout)."""
        bsz, t = cos.shape[0], cos.shape[-2]
        q, k, v = self._qkv(x, cos, sin, batch)
        cache.write(self.layer, batch.slots, batch.write_index, k, v)
        keys, values = cache.read(self.layer, batch.read_slots, key_len)
        want = self.layer in batch.attention_layers
        if batch.row_key_pos is not None:
            # the C++ row-invariant attention (one call; same guarantee as the canonical one below, other bits)
            out = row_attention(q, keys, values, mask, batch.row_key_pos, self.head_dim**-0.5)  # [B, T, Hq, D]
            probs = None
            if want:
                _, probs = tree_attention(q.float(), keys.float(), values.float(), batch.attn_bias_f32,
                                          self.head_dim**-0.5, return_probs=True)
            return self.o_proj(_pack(out.to(q.dtype).view(bsz, t, self.num_heads * self.head_dim), batch)), probs
        if batch.canonical is not None:
            # bfloat16 activations: the row-invariant attention, so a token's result does not depend on the rows
            # beside it (a tree, other slots, more key columns); SDPA's last float32 bits do, and bf16 rounding
            # turns them into other near-tied tokens (speculative != plain decoding at the same weights)
            out = canonical_attention(q, keys, values, batch.canonical, self.head_dim**-0.5).to(q.dtype)
            probs = None
            if want:  # the exported probabilities only (visual attention); the output stays the canonical one
                _, probs = tree_attention(q.float(), keys.float(), values.float(), batch.attn_bias_f32,
                                          self.head_dim**-0.5, return_probs=True)
        elif q.dtype == torch.bfloat16:  # SDPA in float32 (not row-invariant: drafts, or the switch is off)
            out, probs = tree_attention(q.float(), keys.float(), values.float(), batch.attn_bias_f32,
                                        self.head_dim**-0.5, return_probs=want)
            out = out.to(torch.bfloat16)
        else:
            out, probs = tree_attention(q, keys, values, batch.attn_bias, self.head_dim**-0.5, return_probs=want)
        out = out.transpose(1, 2).reshape(bsz, t, self.num_heads * self.head_dim)
        return self.o_proj(_pack(out, batch)), probs


class MLP(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.register_module("gate_up_proj", None)  # ``[gate; up]`` in one product (fuse_projections)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(nn.functional.silu(gate) * up)
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DecoderConfig, layer: int):
        super().__init__()
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, cache, batch, key_len, mask):
        attn, probs = self.self_attn(self.input_layernorm(x), cos, sin, cache, batch, key_len, mask)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, probs


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaDecoder(nn.Module):
    """A Llama/Mistral/Qwen2 causal LM whose forward reads and writes a :class:`KVCache`.

    Build with :func:`specstream.stages.speculative.models.loader.load_decoder`; call :meth:`forward_batch`.
    """

    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        inv_freq, scaling = cfg.rope.inv_freq(cfg.head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.rope_scaling = scaling

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self._fused_args = None

    #: per layer, the C++ layer's weight arguments (:meth:`fused_layer_args`); False: the layers do not fit
    _fused_args: list[tuple] | bool | None = None

    def fused_layer_args(self) -> list[tuple] | None:
        """Per layer, the weight arguments of the C++ decoder layer (:mod:`specstream.kernels.decoder_layer`), or
        None where it does not run these layers: it is unavailable here, or a layer is not int4 in the VNNI
        layout with fused ``qkv``/``gate_up`` products and bfloat16 norms and biases. Decided once per model
        (reset by :meth:`fuse_projections` and :meth:`tie_weights`).

        Raises:
            DecoderLayerUnavailable: ``SPECSTREAM_DECODER_LAYER=cpp`` and the C++ layer cannot run here.
        """
        if self._fused_args is None:
            self._fused_args = self._fit_fused_layers() or False
        return self._fused_args or None

    def _fit_fused_layers(self) -> list[tuple] | None:
        from specstream.kernels import decoder_layer
        from specstream.kernels.quant import Int4Linear

        cfg = self.config
        if not ROW_INVARIANT_ATTENTION or cfg.head_dim % 16 or cfg.head_dim > 256 or self.device.type != "cpu":
            return None
        if not self.model.layers:
            return None

        def fits(lin) -> bool:
            return (isinstance(lin, Int4Linear) and lin.layout == "vnni"
                    and lin.packed_out_features == lin.out_features  # no padded channels: the layer's widths
                    and (lin.bias is None or lin.bias.dtype == torch.bfloat16))

        args = []
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if not all(map(fits, linears)) or any(w.dtype != torch.bfloat16 for w in norms):
                return None
            bias = [None if lin.bias is None else lin.bias.contiguous() for lin in linears]
            args.append((norms[0].detach().contiguous(), norms[1].detach().contiguous(),
                         float(layer.input_layernorm.eps), linears[0].packed, bias[0], linears[1].packed, bias[1],
                         linears[2].packed, bias[2], linears[3].packed, bias[3]))
        # last: the layers fit, so building the extension (the first time on a machine) is worth it
        return args if decoder_layer.available() else None

    def _fused_forward(self, x: torch.Tensor, args: list[tuple], cos: torch.Tensor, sin: torch.Tensor,
                       cache: KVCache, batch: ForwardBatch, key_len: int, mask: torch.Tensor,
                       probs: dict[int, torch.Tensor]) -> torch.Tensor:
        """The layers as C++ calls (:mod:`specstream.kernels.decoder_layer`): ``x`` ``[B, T, hidden]`` or packed
        ``[N, hidden]`` bfloat16, the result in the same layout; exported attention probabilities into ``probs``."""
        from specstream.kernels import decoder_layer, int4_vnni

        ext = decoder_layer.extension()
        cfg = self.config
        bsz, t = batch.input_ids.shape
        shape = x.shape
        x = x.reshape(-1, shape[-1]).contiguous()
        rows = batch.pack if batch.pack is not None else torch.arange(bsz * t, device=x.device)
        d = cfg.head_dim
        cos, sin = cos.reshape(bsz * t, d).contiguous(), sin.reshape(bsz * t, d).contiguous()
        reads = batch.read_slots
        read_first, read_ids = (reads.start, batch.slots) if isinstance(reads, slice) else (-1, reads)
        slots = batch.slots.to(torch.long).contiguous()
        write_index = batch.write_index.to(torch.long).contiguous()
        mask = mask.contiguous()
        pos = batch.row_key_pos.contiguous()
        scale = d**-0.5
        prefetch = int4_vnni.prefetch_distance(x.shape[0])  # every product of the forward has x's rows
        for i, layer_args in enumerate(args):
            want = i in batch.attention_layers
            ln1, ln2, eps, qkv, qkv_b, o, o_b, gu, gu_b, down, down_b = layer_args
            x, q = ext.decoder_layer(x, rows, bsz, t, ln1, ln2, eps, qkv, qkv_b, o, o_b, gu, gu_b, down, down_b,
                                     cfg.num_attention_heads, cfg.num_key_value_heads, d, cos, sin, cache.k[i],
                                     cache.v[i], slots, write_index, read_ids, read_first, mask, pos, scale,
                                     cache.sanitize, prefetch, want)
            if want:  # the exported probabilities only; the output is the C++ layer's
                keys, values = cache.read(i, reads, key_len)
                _, probs[i] = tree_attention(q.float(), keys.float(), values.float(), batch.attn_bias_f32, scale,
                                             return_probs=True)
        return x.view(shape)

    def fuse_projections(self) -> int:
        """Replace each layer's quantized ``q``/``k``/``v`` projections by one ``qkv_proj`` and ``gate``/``up``
        by one ``gate_up_proj`` (:func:`specstream.kernels.quant.fuse_linears`: bit-identical outputs, fewer
        kernel calls per layer). Layers whose projections cannot be fused stay as they are.
        Returns the number of fused projections."""
        from specstream.kernels.quant import fuse_linears

        count = 0
        for layer in self.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            fused = fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj])
            if fused is not None:
                attn.qkv_proj = fused
                del attn.q_proj, attn.k_proj, attn.v_proj
                count += 1
            fused = fuse_linears([mlp.gate_proj, mlp.up_proj])
            if fused is not None:
                mlp.gate_up_proj = fused
                del mlp.gate_proj, mlp.up_proj
                count += 1
        self._fused_args = None
        return count

    #: activations and KV cache dtype when set by the loader (bfloat16 for int8/int4 weights)
    activation_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:
        """Dtype of activations and the KV cache (the weights' for float weights, bfloat16 for int8/int4)."""
        return self.activation_dtype or self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, num_slots: int, max_len: int) -> KVCache:
        cfg = self.config
        return KVCache(
            cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim, self.dtype, self.device
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[B, T, hidden]`` for ``input_ids`` ``[B, T]``."""
        return self.model.embed_tokens(input_ids)

    def _rope(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids.float()[..., None] * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.rope_scaling).to(dtype)[:, None]
        sin = (emb.sin() * self.rope_scaling).to(dtype)[:, None]
        return cos, sin

    @torch.inference_mode()
    def forward_batch(
        self, cache: KVCache, batch: ForwardBatch
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the decoder over ``batch``, writing its keys/values into ``cache``.

        Returns:
            ``(logits [B, R, vocab] float32, {layer: attention probs [B, Hq, T, S]})``.
        """
        if batch.input_ids.ndim != 2 or batch.attn_mask.ndim != 3:
            raise ValueError("input_ids must be [B, T] and attn_mask [B, T, S]")
        x = batch.inputs_embeds if batch.inputs_embeds is not None else self.embed(batch.input_ids)
        x = x.to(self.dtype)
        bsz, t = batch.input_ids.shape
        batch.pack = None
        lengths = batch.row_lengths
        if lengths is not None and sum(lengths) < bsz * t and not batch.attention_layers:
            # packed: the linear layers see the real tokens only (host-built index, no device sync)
            batch.pack = torch.tensor([b * t + j for b, n in enumerate(lengths) for j in range(n)],
                                      device=x.device)
            x = x.reshape(bsz * t, -1).index_select(0, batch.pack)
        key_len = batch.attn_mask.shape[-1]
        mask = batch.attn_mask
        # remember the position id stored in every written column (sliding-window masks need it)
        cache.positions[batch.slots[:, None], batch.write_index] = batch.position_ids
        batch.resolve_reads()
        if self.config.sliding_window is not None:
            key_pos = cache.positions[batch.slots, :key_len]
            window = (batch.position_ids[:, :, None] - key_pos[:, None, :]) < self.config.sliding_window
            mask = mask & window
            mask[:, :, 0] |= ~mask.any(-1)
        batch.canonical = batch.row_key_pos = None  # this forward's own choice, below
        fused = self.fused_layer_args() if x.dtype == torch.bfloat16 and x.device.type == "cpu" else None
        if fused is not None:
            # every forward of this decoder (target and drafts alike) runs its layers in C++, with the
            # row-invariant attention; the additive bias only where attention probabilities are exported
            batch.row_key_pos = cache.positions[batch.read_slots, :key_len]
            batch.attn_bias = batch.attn_bias_f32 = None
            if batch.attention_layers:
                batch.attn_bias = attention_bias(mask, x.dtype)
                batch.attn_bias_f32 = batch.attn_bias.float()
            cos, sin = self._rope(batch.position_ids, x.dtype)
            probs: dict[int, torch.Tensor] = {}
            x = self._fused_forward(x, fused, cos, sin, cache, batch, key_len, mask, probs)
            return self._logits(x, batch, bsz, t), probs
        batch.attn_bias = attention_bias(mask, x.dtype)
        canonical = batch.row_invariant and x.dtype == torch.bfloat16 and ROW_INVARIANT_ATTENTION
        batch.attn_bias_f32 = (batch.attn_bias.float() if x.dtype == torch.bfloat16
                               and (batch.attention_layers or not canonical) else None)
        if canonical and x.device.type == "cpu" and _row_kernel():
            batch.row_key_pos = cache.positions[batch.read_slots, :key_len]
            mask = mask.contiguous()
        elif canonical:
            cfg = self.config
            batch.canonical = canonical_plan(mask, batch.write_index, batch.position_ids,
                                             cfg.num_attention_heads // cfg.num_key_value_heads, batch.tree_rows,
                                             batch.tree_width or batch.input_ids.shape[1])
        cos, sin = self._rope(batch.position_ids, x.dtype)
        probs: dict[int, torch.Tensor] = {}
        for layer in self.model.layers:
            x, p = layer(x, cos, sin, cache, batch, key_len, mask)
            if p is not None:
                probs[layer.self_attn.layer] = p
        return self._logits(x, batch, bsz, t), probs

    def _logits(self, x: torch.Tensor, batch: ForwardBatch, bsz: int, t: int) -> torch.Tensor:
        """Logits ``[B, R, V]`` float32 of the rows ``batch`` asks for, from the last layer's output."""
        if batch.pack is not None:
            return self._packed_logits(x, batch, bsz, t)
        if batch.logit_index is not None:
            x = torch.gather(x, 1, batch.logit_index[:, :, None].expand(-1, -1, x.shape[-1]))
        x = self.model.norm(x)
        return self.lm_head(x).float()

    def _packed_logits(self, x: torch.Tensor, batch: ForwardBatch, bsz: int, t: int) -> torch.Tensor:
        """Logits ``[B, R, V]`` float32 from the packed hidden states ``[N, hidden]``: the output head runs once
        per distinct real row asked for; rows that ask for padding get a copy of another row's logits (finite,
        never read as a token's). Row ``b``'s token ``j`` is packed row ``offsets[b] + j``."""
        lengths = batch.row_lengths
        if batch.logit_index is None:
            want = [list(range(t))] * bsz
        else:
            want = batch.logit_index_host if batch.logit_index_host is not None else batch.logit_index.tolist()
        offsets = [0]
        for n in lengths[:-1]:
            offsets.append(offsets[-1] + n)
        packed = [[offsets[b] + j if j < lengths[b] else -1 for j in row] for b, row in enumerate(want)]
        rows = sorted({r for row in packed for r in row if r >= 0}) or [0]  # [0]: only padding asked
        slot = {r: i for i, r in enumerate(rows)}
        index = [slot.get(r, 0) for row in packed for r in row]
        dev = x.device
        h = self.model.norm(x.index_select(0, torch.tensor(rows, device=dev)))
        logits = self.lm_head(h).float()
        return logits.index_select(0, torch.tensor(index, device=dev)).view(bsz, len(want[0]), -1)
