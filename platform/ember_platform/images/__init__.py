"""Image builds as the control plane runs them: on a worker node, once per cluster."""
