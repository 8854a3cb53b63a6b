"""What the SDK, the control plane and the worker agree on: wire types, sizes, labels and
framing.
"""
