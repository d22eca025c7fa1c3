"""What every route needs: the engine, its limits, the metrics, the server's state."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from fastapi import Request

from berth.engine.engine_io import EngineLimits
from berth.engine.serve.body_limit import DEFAULT_MAX_REQUEST_BODY_BYTES
from berth.engine.serve.errors import APIError, unavailable
from berth.engine.serve.loading import Loading
from berth.engine.serve.metrics import ServerMetrics


@dataclass
class ServingContext:
    llm: object  # berth.engine.LLM (not imported: the type would pull torch into this module)
    model_name: str
    model_path: str
    metrics: ServerMetrics
    api_key: str | None = None
    admin_token: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    draining: bool = False  # set on SIGTERM (`start_draining`): readiness drops, new requests are refused
    # The engine requests in flight, by the task that reads each to its end (even after its
    # HTTP request is gone). asyncio holds tasks weakly: they are kept here until done.
    in_flight: dict[asyncio.Task, object] = field(default_factory=dict)
    # While the engine loads (`llm` is None until then): its progress, for the loading gate.
    loading: Loading | None = None
    # The name the deployer gave the weights serving (`--model-revision`, or a wakeup's
    # `revision`): the digest says what is there, the label what it was meant to be.
    model_label: str | None = None
    # The engine owner's attach endpoint (AttachEndpoint), once frontends can attach: a drain
    # waits for their requests too.
    frontends: object | None = None
    reasoning_parser: str | None = None  # `--reasoning-parser`: how thinking is split from an answer
    tool_call_parser: str | None = None  # `--tool-call-parser`; None: the chat template's format
    role: str = "both"  # in disaggregated serving (`disaggregated.py`): context, generation or both

    @classmethod
    def for_llm(cls, llm, model_name: str | None = None, **options) -> ServingContext:
        model_path = str(llm.config.model)
        return cls(
            llm=llm,
            model_name=model_name or model_path,
            model_path=model_path,
            metrics=ServerMetrics(model_name or model_path),
            **options,
        )

    @property
    def limits(self) -> EngineLimits:
        """As the engine reported them when it started (an attached frontend's: the engine it is
        attached to now): the server checks the same."""
        return self.llm.limits

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def check_model(self, requested: str | None) -> None:
        if requested is not None and requested != self.model_name:
            raise APIError(
                404, f"The model `{requested}` does not exist.", param="model", code="model_not_found"
            )

    def check_admitting(self) -> None:
        if self.draining:
            raise unavailable("the server is shutting down and admits no new requests", "shutting_down")

    def start_draining(self) -> None:
        """SIGTERM: this server admits nothing new and stops being ready; the engine's owner
        also stops admitting every attached frontend's requests (they answer 503 and stop
        being ready at once). What is in flight, everywhere, runs on (see `idle`)."""
        self.draining = True
        if self.llm is not None and self.frontends is not None:
            self.llm.executor.stop_admission("the engine's owner is shutting down")

    def keep(self, task: asyncio.Task, result) -> None:
        """Tracks `result` (a GenerationResult) until `task`, which reads it, is done."""
        self.in_flight[task] = result
        task.add_done_callback(lambda done: self.in_flight.pop(done, None))

    @property
    def idle(self) -> bool:
        """Nothing in flight: none of this server's requests, and, on the engine's owner, none
        of an attached frontend's."""
        return not self.in_flight and (self.frontends is None or self.frontends.idle)

    def abort_all(self) -> None:
        """Aborts every engine request in flight, the attached frontends' too: each ends with
        finish_reason "abort"."""
        for result in list(self.in_flight.values()):
            result.abort()
        if self.frontends is not None:
            self.frontends.abort_all()


def serving(request: Request) -> ServingContext:
    return request.app.state.serving
