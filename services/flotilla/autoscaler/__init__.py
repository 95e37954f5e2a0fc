"""Local autoscaling: the control law of flotilla.autoscaling.control run against worker processes."""
