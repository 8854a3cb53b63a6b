"""The control plane's core: the live picture (endpoints with their queues, replicas,
workers, inputs) and the parts that change it, composed by `Cluster` (cluster.py).
Nothing here knows HTTP.
"""
