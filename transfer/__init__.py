"""The runtime: receiver, sender, controller, pipeline, control plane and CLI."""
