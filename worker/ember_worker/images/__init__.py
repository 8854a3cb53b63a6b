"""Building `ember.Image`s on a worker node: each step's file changes captured as an OCI
layer, stored content-addressed through the control plane, kept unpacked on the node."""
