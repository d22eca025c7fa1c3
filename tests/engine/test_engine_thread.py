"""`PyExecutor.launch`: the thread that runs the loop is the thread that built the model (torch
keeps an OpenMP pool per calling thread; two pools contending slowed every step 2-3x)."""

from __future__ import annotations

import queue
import threading

import pytest

from berth.engine.config import EngineConfig
from berth.engine.executor import GenerationRequest
from berth.engine.models.parallel import SINGLE
from berth.engine.pyexecutor.py_executor import PyExecutor
from berth.engine.sampling_params import SamplingParams


class ThreadRecordingExecutor(PyExecutor):
    """Notes which thread builds the engine and which steps it."""

    built_on: int | None = None
    stepped_on: set[int]

    @classmethod
    def from_config(cls, config: EngineConfig, tp=SINGLE, on_progress=None) -> PyExecutor:
        cls.built_on = threading.get_ident()
        engine = super().from_config(config, tp, on_progress)
        engine.stepped_on = set()
        return engine

    def step(self):
        self.stepped_on.add(threading.get_ident())
        return super().step()


def test_the_loop_runs_on_the_thread_that_built_the_model(tiny_model):
    engine = ThreadRecordingExecutor.launch(EngineConfig(model=str(tiny_model), kv_cache_blocks=16))
    responses: queue.SimpleQueue = queue.SimpleQueue()
    engine.start(
        on_responses=lambda batch, stats: responses.put(batch),
        on_fatal=responses.put,
        on_transition=responses.put,
    )
    request = GenerationRequest([5, 6, 7], SamplingParams(temperature=0, max_tokens=3), request_id=1)
    engine.request_queue.enqueue_request(request)
    finished = False
    while not finished:
        batch = responses.get(timeout=30)
        assert isinstance(batch, list), batch
        finished = any(r.finish_reason for r in batch)
    engine.request_queue.enqueue_shutdown()
    assert engine.join(10)
    assert ThreadRecordingExecutor.built_on != threading.get_ident()
    assert engine.stepped_on == {ThreadRecordingExecutor.built_on}


def test_a_failed_build_raises_its_root_cause_in_the_caller(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"config\.json"):
        PyExecutor.launch(EngineConfig(model=str(tmp_path)))
