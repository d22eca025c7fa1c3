"""The checks `make gpu-check` runs on a GPU machine (`tools/gpu_check.py` runs each in a process
of its own, with a time budget, and puts their results into one table and one JSON report):

- `environment`: the machine, the versions, and the two ceilings every figure is read against
  (device-to-device copy bandwidth, bf16 matmul rate);
- `berth.kernels.gpu_check` (in the kernels room): the Triton kernels against the torch
  reference, timed against torch;
- `parity`: the engine on CUDA against transformers on CUDA, greedy;
- `decode`: decode speed on a random model with Llama-3-8B's shapes, against the roofline and
  against transformers, with and without CUDA graphs;
- `sleep`: sleep and wakeup on CUDA, the device memory each level gives back;
- `serve`: `berth serve` on CUDA answering an OpenAI request.

Each module's `main(argv)` takes `--json PATH` (where its result goes) and `--dry-run` (the same
code paths on the CPU with tiny shapes, so the suite tests the plumbing without a GPU).
"""
