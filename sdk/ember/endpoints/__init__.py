"""What an endpoint is: the decorators, their settings, and what is read from the user's code at
deploy.
"""
