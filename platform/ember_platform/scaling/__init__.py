"""How many replicas each endpoint runs, and where, as pure policies (autoscaler: how many;
scheduler: on which node), and the autoscaling settings changed without a deploy
(`ember scale`); the control loop that applies them is core/controller.py. Nothing here
knows HTTP.
"""
