"""berth.operator: the Kubernetes operator for LLMDeployment."""
