"""How many replicas each endpoint runs, and where: the control loop (controller), its pure
policies (autoscaler: how many; scheduler: on which node), and the autoscaling settings
changed without a deploy (`ember scale`). Nothing here knows HTTP.
"""
