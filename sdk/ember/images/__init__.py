"""Images: the system an endpoint's replicas run on, declared in code (`ember.Image`)."""
