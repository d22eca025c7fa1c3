"""berth.kernels: the engine's hot operations behind one interface (`dispatch`), with a Triton,
a CPU and a torch reference implementation of each."""

if __name__ != "berth.kernels":  # imported as a top-level `kernels` from the checkout root
    from berth._rooms import step_aside

    step_aside(__name__, __file__)
else:
    from berth.kernels.dispatch import *  # noqa: F403 (the interface, named in its __all__)
    from berth.kernels.dispatch import __all__  # noqa: F401
