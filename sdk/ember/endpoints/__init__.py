"""What an endpoint is: the decorators, what is read from the user's code at deploy (its
parameters' kinds), and what runs with it in the replica (batching, multiplexing, the
current input's affinity key). Its settings are declarations/.
"""
