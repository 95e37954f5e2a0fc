"""`kopf run -m flotilla.operator.main --all-namespaces`: the operator with settings from the environment."""

from __future__ import annotations

import kopf

from flotilla.operator.config import OperatorConfig
from flotilla.operator.handlers import register_handlers

register_handlers(kopf.get_default_registry(), OperatorConfig.from_env())
