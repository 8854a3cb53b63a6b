"""The control plane's core: endpoints with their queues, dispatch, replicas, workers, the control
loop, and its pure policies (autoscaler, scheduler). Nothing here knows HTTP.
"""
