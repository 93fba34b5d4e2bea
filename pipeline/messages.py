"""Versioned message schemas of the stage graph (pydantic). The same models serve every entry point: the
``caption`` command (in-process broker), the Kafka worker and the HTTP API.

Wire format of requests and results (JSON, ``schema_version`` 1) is documented in ``docs/kafka.md``; their
JSON Schemas are ``docs/schemas/*.json`` (``python -m specstream.pipeline.messages docs/schemas`` rewrites them).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SCHEMA_VERSION = 1
Task = Literal["caption", "transcribe", "generate", "video_qa"]
Qos = Literal["realtime", "interactive", "batch"]


class Source(BaseModel):
    """Where the media is: a URI (``file:///...`` or a plain path) or inline base64 bytes."""

    model_config = ConfigDict(extra="forbid")
    uri: str | None = None
    data_b64: str | None = None
    filename: str | None = Field(None, description="name hint for inline data (its extension tells the kind)")

    @model_validator(mode="after")
    def _one_of(self):
        if (self.uri is None) == (self.data_b64 is None):
            raise ValueError("source needs exactly one of 'uri' or 'data_b64'")
        return self


class CaptionParams(BaseModel):
    # the field is ``schema_`` in Python (``BaseModel.schema`` is pydantic's), ``schema`` on the wire
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)
    prompt: str = "Describe this image."
    max_new_tokens: int = Field(32, ge=1, le=4096)
    max_keyframes_per_minute: float | None = Field(None, gt=0)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        "a JSON Schema the caption must follow (grammar-constrained decoding): the record's caption is then the "
        "parsed JSON object, or the partial text with finish_reason 'length'; a schema that cannot be compiled "
        "is an 'invalid_schema' error record"))

    @property
    def schema(self) -> dict[str, Any] | None:
        return self.schema_


class Question(BaseModel):
    """One question about a video (``video_qa``)."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=256)
    text: str = Field(max_length=16384, description="an empty text gets an 'empty_question' error result")
    draft_tokens: list[int] | None = Field(None, max_length=4096, description=(
        "token ids to draft the answer from (a resumed job passes the previous question's answer); default: the "
        "previous answer of this request"))


class QaParams(BaseModel):
    """Params of a ``video_qa`` request: one result per question, in order (``seq`` = the question's index)."""

    # the field is ``schema_`` in Python (``BaseModel.schema`` is pydantic's), ``schema`` on the wire
    model_config = ConfigDict(extra="forbid", populate_by_name=True, serialize_by_alias=True)
    video_id: str | None = Field(None, max_length=256, description="the manifest's video id (default: the request id)")
    questions: list[Question] = Field(min_length=1, max_length=4096)
    max_frames: int = Field(4, ge=1, le=64, description="frames shown per question, at most")
    max_visual_tokens: int | None = Field(None, ge=1, description="visual tokens per question, at most")
    max_new_tokens: int = Field(32, ge=1, le=4096)
    max_transcript_tokens: int = Field(256, ge=0, description="transcript tokens in a prompt, at most")
    use_transcript: bool = True
    answer_with: Literal["vlm", "text"] = Field("vlm", description="text: the text model, from the transcript")
    max_keyframes_per_minute: float | None = Field(None, gt=0)
    schema_: dict[str, Any] | None = Field(None, alias="schema", description=(
        "a JSON Schema every answer must follow (grammar-constrained decoding): the result's answer is then the "
        "parsed JSON value, or the partial text with finish_reason 'length'; a schema that cannot be compiled is "
        "an 'invalid_schema' error result"))

    @property
    def schema(self) -> dict[str, Any] | None:
        return self.schema_

    @model_validator(mode="after")
    def _unique_questions(self):
        ids = [q.id for q in self.questions]
        if len(set(ids)) != len(ids):
            raise ValueError("question ids must be unique within a request")
        return self


class TranscribeParams(BaseModel):
    """Params of a ``transcribe`` request (one result: the transcript with segment times)."""

    model_config = ConfigDict(extra="forbid")
    language: str | None = Field(None, max_length=16, description="None: the model's default or detection")


class GenerateParams(BaseModel):
    """Params of a ``generate`` request: a text prompt (with the request's image source, if any, shown before it)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str = Field(min_length=1, max_length=1 << 20)
    chat: bool = Field(True, description="apply the model's chat template (False: the prompt as it is)")
    model: Literal["vlm", "text"] = "vlm"
    max_new_tokens: int = Field(32, ge=1, le=4096)
    temperature: float = Field(0.0, ge=0.0, le=2.0, description="0: greedy")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int = 0


class PipelineRequest(BaseModel):
    """A request on ``specstream.requests``. ``source`` is required except for ``generate`` (a text prompt)."""

    model_config = ConfigDict(extra="forbid")
    schema_version: int = SCHEMA_VERSION
    id: str = Field(min_length=1, max_length=256)
    task: Task = "caption"
    source: Source | None = None
    qos: Qos = "interactive"
    params: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _source_needed(self):
        if self.source is None and self.task != "generate":
            raise ValueError(f"task {self.task!r} needs a source")
        return self


class CaptionRecord(BaseModel):
    """One caption: per keyframe of a video, or per image (the ``caption`` command's JSONL line)."""

    source: str
    kind: Literal["video", "image"]
    frame_index: int
    timestamp_s: float
    caption: str | dict[str, Any] | list[Any] | int | float | bool | None = Field(description=(
        "the caption text; with a schema, the parsed JSON value (the partial text when finish_reason is 'length')"))
    tokens: list[int]
    scene_score: float
    stats: dict[str, Any]
    finish_reason: Literal["eos", "length"] | None = Field(None, description="with a schema only")


class ErrorInfo(BaseModel):
    code: str
    message: str


class ErrorRecord(BaseModel):
    source: str
    error: ErrorInfo


class PipelineResult(BaseModel):
    """A result on ``specstream.results`` (keyed by request id). ``seq`` numbers the results of one request;
    ``final`` marks its last. Results are idempotent by (``id``, ``seq``)."""

    schema_version: int = SCHEMA_VERSION
    id: str
    status: Literal["ok", "error"]
    output: dict[str, Any] | None = None
    error: ErrorInfo | None = None
    seq: int
    final: bool


def json_schemas() -> dict[str, dict[str, Any]]:
    """JSON Schema of each wire message: request, the params of each task, result, and a caption result's output."""
    return {"request": PipelineRequest.model_json_schema(), "caption_params": CaptionParams.model_json_schema(),
            "video_qa_params": QaParams.model_json_schema(), "transcribe_params": TranscribeParams.model_json_schema(),
            "generate_params": GenerateParams.model_json_schema(),
            "result": PipelineResult.model_json_schema(), "caption_record": CaptionRecord.model_json_schema()}


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/schemas")
    out.mkdir(parents=True, exist_ok=True)
    for name, schema in json_schemas().items():
        (out / f"{name}.json").write_text(json.dumps(schema, indent=2) + "\n")
