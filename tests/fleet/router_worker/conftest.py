from tests.support.engines import tiny_engine  # noqa: F401
