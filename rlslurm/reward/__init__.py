"""The reward service: scorers, sandbox, supervisor and the controller's client."""
