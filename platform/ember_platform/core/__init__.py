"""The control plane's core: the parts that change the live picture (runtime/), composed by
`Cluster` (cluster.py), and the control loop that sizes and places endpoints
(controller.py). Nothing here knows HTTP.
"""
