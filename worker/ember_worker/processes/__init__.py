"""Replica processes on the node: how they start, in their namespaces and cgroups, and why they
end.
"""
