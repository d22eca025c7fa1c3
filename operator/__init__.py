"""berth.operator: the Kubernetes operator for LLMDeployment."""

if __name__ != "berth.operator":  # imported as a top-level `operator` from the checkout root
    from berth._rooms import step_aside

    step_aside(__name__, __file__)
