"""POST /v1/embeddings request and response bodies: OpenAI's shapes plus vLLM's extras, as pydantic models.

`input` is a string, a list of strings, a list of token ids or a list of token-id lists (OpenAI's four forms);
`encoding_format` "base64" packs each vector as little-endian float32 (what the openai SDK asks for by default
and decodes itself). Usage counts prompt tokens only, as OpenAI's does.
"""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from engine.sample.sampling_params import INT64_LIMIT
from engine.entrypoints.openai.protocol import NonEmptyText, RequestBody, Text, TokenIds

MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on inputs per request

EmbeddingInput = NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)] \
    | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]


class EmbeddingRequest(RequestBody):
    model: Text | None = None
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, lt=INT64_LIMIT, description="Matryoshka models: truncate to this "
                                   "many dimensions (then renormalise)")
    user: Text | None = None
    add_special_tokens: bool = Field(True, description="vLLM: add the tokenizer's special tokens (an embedding "
                                     "model's EOS, which last-token pooling reads)")
    truncate_prompt_tokens: int | None = Field(None, ge=-1, lt=INT64_LIMIT,
                                               description="vLLM: keep the last k tokens of each input; -1: "
                                                           "max_model_len")
    normalize: bool | None = Field(None, description="vLLM: L2-normalise (default: as the model does)")
    priority: int = Field(0, ge=-2**31, lt=2**31, description="vLLM: with --scheduling-policy priority, lower "
                                                                "values are served first")
    request_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")] | None = Field(
        None, description="vLLM: the response id is embd- + this (must not be in use)")


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64 of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage
