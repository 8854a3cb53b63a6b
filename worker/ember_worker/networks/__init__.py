"""Networks of their own for replicas and image build steps: namespaces, their egress."""
