"""Local autoscaling: the control law of flotilla.autoscaler.control run against worker processes."""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
