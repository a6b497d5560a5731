"""What operators read: Prometheus metrics and the logs' set-up."""
