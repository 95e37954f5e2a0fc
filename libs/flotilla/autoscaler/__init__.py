"""Autoscaling: the pure control law (`control`), its inputs (`signals`) and the pool policy (`policy`).

`flotilla.autoscaler` is split over two source roots: the pure parts here (libs/), the local process
supervisor in services/flotilla/autoscaler/. extend_path joins both folders into one package.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)
