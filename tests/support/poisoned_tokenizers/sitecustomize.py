"""A test double of Hugging Face `tokenizers`' `DecodeStream` whose `step` raises on one token id.

Real decoders do raise mid-stream ("Invalid prefix encountered" on some Llama-3 and Gemma-3
sequences, OverflowError on some ids). A process started with this folder on PYTHONPATH and
BERTH_TEST_POISON_TOKEN=ID gets the double in place of the real class before berth imports
it; the processes it starts (engine workers, postprocess workers) inherit both variables.

Only streams that keep special tokens (`skip_special_tokens=False`) are poisoned: one request
asks for that, so it alone meets the fault whatever tokens its neighbours happen to generate.
"""

import os

POISON_ENV = "BERTH_TEST_POISON_TOKEN"


def _install(poison: int) -> None:
    import tokenizers.decoders

    real = tokenizers.decoders.DecodeStream

    class PoisonedDecodeStream:
        def __init__(self, *args, skip_special_tokens: bool = False, **kwargs) -> None:
            self._stream = real(*args, skip_special_tokens=skip_special_tokens, **kwargs)
            self._poisoned = not skip_special_tokens

        def step(self, tokenizer, token_id: int):
            if self._poisoned and token_id == poison:
                raise Exception(f"Invalid prefix encountered (test double: token {token_id} is poisoned)")
            return self._stream.step(tokenizer, token_id)

    tokenizers.decoders.DecodeStream = PoisonedDecodeStream


if os.environ.get(POISON_ENV):
    _install(int(os.environ[POISON_ENV]))
