"""The engine loop: request queue, waiting queue, scheduler, KV cache, model runner, sampler."""
