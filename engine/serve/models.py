"""`GET /v1/models`: the one model this server serves, under its served name."""

from __future__ import annotations

from fastapi import APIRouter, Request

from berth.engine.serve.auth import BEARER
from berth.engine.serve.context import ServingContext, serving
from berth.engine.serve.errors import documented
from berth.engine.serve.protocol import ModelCard, ModelList

router = APIRouter(prefix="/v1/models", dependencies=BEARER, responses=documented(401))


def _card(ctx: ServingContext) -> ModelCard:
    revision = ctx.llm.executor.model_revision  # what serves now: a wakeup may have swapped it
    return ModelCard(
        id=ctx.model_name,
        root=revision.path if revision is not None else ctx.model_path,
        revision=revision.digest if revision is not None else None,
        max_model_len=ctx.max_model_len,
    )


@router.get("")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_card(serving(request))])


@router.get("/{model:path}", responses=documented(404))
async def retrieve_model(model: str, request: Request) -> ModelCard:
    ctx = serving(request)
    ctx.check_model(model)
    return _card(ctx)
